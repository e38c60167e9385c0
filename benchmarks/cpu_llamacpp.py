"""llama.cpp, the CPU peer, on the C1 shape: batch-1 decode (C2) and 32 sequences of 160 + 96 tokens (C1-like).

llama.cpp is built by hand under /tmp (see ../shared/peers/README.md; never committed) and the C1 model
written as GGUF with ../shared/peers/c1_gguf.py. This module runs its own benchmark tools and returns:

- ``llama-bench -p 64 -n 64``: tg64 tokens/s, reported as ms per output token (C2);
- ``llama-batched-bench -npp 160 -ntg 96 -npl 32``: output tokens / total time (end to end) and the decode
  rate alone (C1-like).

Usage (also called by cpu_c1c2.py with ``--llamacpp-bin``)::

    python benchmarks/cpu_llamacpp.py --bin /tmp/llamacpp/.../build/bin --gguf /tmp/llamacpp/c1-f32.gguf
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path


def c2_ms_per_token(bin_dir: str, gguf: str, threads: int) -> float:
    out = subprocess.run([str(Path(bin_dir) / "llama-bench"), "-m", gguf, "-p", "0", "-n", "64", "-t", str(threads),
                          "-o", "json"], capture_output=True, text=True, check=True, timeout=900).stdout
    rows = json.loads(out)
    tg = next(r for r in rows if r.get("n_gen", 0) > 0)
    return 1000.0 / float(tg["avg_ts"])


def c1_like(bin_dir: str, gguf: str, threads: int, seqs: int = 32, prompt: int = 160, output: int = 96) -> dict:
    """Output tokens/s end to end and decode-only tokens/s of ``seqs`` x (``prompt`` + ``output``)."""
    cmd = [str(Path(bin_dir) / "llama-batched-bench"), "-m", gguf, "-c", "16384", "-b", "2048", "-ub", "512",
           "-npp", str(prompt), "-ntg", str(output), "-npl", str(seqs), "-t", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800).stdout
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0] == str(prompt) and cells[2] == str(seqs):
            total_s, decode_ts = float(cells[8]), float(cells[7])
            return {"output_tok_s": seqs * output / total_s, "decode_tok_s": decode_ts, "total_s": total_s}
    raise RuntimeError(f"could not read llama-batched-bench's table:\n{out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin", required=True, help="llama.cpp's build/bin directory")
    parser.add_argument("--gguf", required=True, help="the C1 model as GGUF (f32)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(json.dumps({"llama.cpp C2 ms/tok": round(c2_ms_per_token(args.bin, args.gguf, args.threads), 2),
                      "llama.cpp C1-like": c1_like(args.bin, args.gguf, args.threads)}))


if __name__ == "__main__":
    main()
