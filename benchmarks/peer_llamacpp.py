"""llama.cpp, the CPU peer, on the C1 shape: batch-1 decode (C2) and 32 sequences of 160 + 96 tokens (C1-like).

llama.cpp is built by hand outside the repository (docs/benchmarks.md, "llama.cpp"; never committed), and the C1
model written as GGUF by ``--write-gguf``. This module runs llama.cpp's own benchmark tools and returns:

- ``llama-bench -p 64 -n 64``: tg64 tokens/s, reported as ms per output token (C2);
- ``llama-batched-bench -npp 160 -ntg 96 -npl 32``: output tokens / total time (end to end) and the decode
  rate alone (C1-like).

Usage (also called by cpu_c1c2.py with ``--llamacpp-bin``)::

    python benchmarks/peer_llamacpp.py --write-gguf c1-f32.gguf [--ftype f16]   # needs gguf and numpy
    python benchmarks/peer_llamacpp.py --bin LLAMA_CPP/build/bin --gguf c1-f32.gguf
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


def write_c1_gguf(path: str, ftype: str = "f32") -> None:
    """The C1 model (Llama: hidden 512, 8 layers, 8 heads, 4 KV heads, ffn 1376, vocab 32000) as GGUF with random
    weights (seed 0), for llama.cpp's tools."""
    import gguf
    import numpy as np

    dtype = np.float32 if ftype == "f32" else np.float16
    rng = np.random.default_rng(0)
    hidden, layers, heads, kv_heads, ffn, vocab = 512, 8, 8, 4, 1376, 32000
    head_dim = hidden // heads
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(1024)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if ftype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("llama")
    w.add_token_list([b"<unk>", b"<s>", b"</s>"] + [f"t{i}".encode() for i in range(3, vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
                      + [gguf.TokenType.NORMAL] * (vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)

    def random(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(dtype)

    def ones(n):
        return np.ones(n, dtype=np.float32)

    w.add_tensor("token_embd.weight", random(vocab, hidden))
    w.add_tensor("output_norm.weight", ones(hidden))
    w.add_tensor("output.weight", random(vocab, hidden))
    for i in range(layers):
        prefix = f"blk.{i}."
        w.add_tensor(prefix + "attn_norm.weight", ones(hidden))
        w.add_tensor(prefix + "ffn_norm.weight", ones(hidden))
        w.add_tensor(prefix + "attn_q.weight", random(hidden, hidden))
        w.add_tensor(prefix + "attn_k.weight", random(kv_heads * head_dim, hidden))
        w.add_tensor(prefix + "attn_v.weight", random(kv_heads * head_dim, hidden))
        w.add_tensor(prefix + "attn_output.weight", random(hidden, hidden))
        w.add_tensor(prefix + "ffn_gate.weight", random(ffn, hidden))
        w.add_tensor(prefix + "ffn_up.weight", random(ffn, hidden))
        w.add_tensor(prefix + "ffn_down.weight", random(hidden, ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin", help="llama.cpp's build/bin directory")
    parser.add_argument("--gguf", help="the C1 model as GGUF (f32)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--write-gguf", metavar="PATH", help="only write the C1 model as GGUF to PATH")
    parser.add_argument("--ftype", choices=("f32", "f16"), default="f32")
    args = parser.parse_args()
    if args.write_gguf:
        write_c1_gguf(args.write_gguf, args.ftype)
        print("wrote", args.write_gguf)
        return
    if not (args.bin and args.gguf):
        parser.error("--bin and --gguf are required (or --write-gguf)")
    print(json.dumps({"llama.cpp C2 ms/tok": round(c2_ms_per_token(args.bin, args.gguf, args.threads), 2),
                      "llama.cpp C1-like": c1_like(args.bin, args.gguf, args.threads)}))


if __name__ == "__main__":
    main()
