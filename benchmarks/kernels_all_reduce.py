"""The tensor-parallel all-reduce alone on the GPUs of one host: NCCL against torch symmetric memory, size by size.

    python benchmarks/kernels_all_reduce.py [--world-size 2] [--sizes 8K,64K,...,128M] [--hidden 4096] \
        [--json results.json]

One process per GPU. For each message size (bfloat16 bytes; a decode step of T tokens of hidden H is
``2 * T * H``) it times, from CUDA graphs (how the engine runs decode), in-place sums of one tensor,
``kernels_linear.CALLS`` to a graph:

- ``nccl``: ``torch.distributed.all_reduce`` (NCCL, multicast off as the environment says);
- ``one_shot``: torch symmetric memory's one-shot kernel, the input copied into the symmetric buffer by the
  kernel itself (each rank reads every peer's buffer over NVLink);
- ``two_shot``: the input copied into the buffer, then the two-shot kernel (reduce-scatter, all-gather);
- ``engine``: what the engine runs for that size (:class:`dovetail_cuda.symm_mem_all_reduce.SymmMemAllReduce`
  where it takes the message, NCCL where it does not).

Where FlashInfer's communication kernels load, two more, on ``[bytes / 2 / hidden, hidden]`` messages with a
residual and a norm weight (what follows each attention and MLP block of a Llama-style layer):

- ``steps``: ``engine`` then the Triton residual add and RMSNorm (two kernels);
- ``fused``: FlashInfer's all-reduce fused with them (:mod:`dovetail_cuda.flashinfer_all_reduce`, its
  workspace sized here for the largest message; the engine's stops at ``FUSED_MAX_BYTES``), one-shot or
  two-shot as FlashInfer chooses by size (the engine's way);
- ``fused_one_shot``, ``fused_two_shot``: the same kernel with that algorithm forced (two-shot needs more rows
  than ranks).

Each result is first checked against NCCL's on random inputs. Prints µs per all-reduce and the algorithm
bandwidth (message bytes / time) from rank 0; the median of ``kernels_linear.REPLAYS`` replays, the ranks meeting
at a barrier before each.
"""

from __future__ import annotations

import argparse
import json
import os
import socket

import torch
import torch.multiprocessing as mp

from kernels_linear import time_graph
DEFAULT_SIZES = "8K,16K,32K,64K,128K,256K,512K,1M,2M,4M,8M,16M,32M,64M,128M"


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _rank(rank: int, world_size: int, port: int, sizes: list[int], hidden: int, results) -> None:
    import torch.distributed as dist

    from dovetail import distributed
    from dovetail.triton.fused_ops import TritonFusedOps
    from dovetail_cuda.flashinfer_all_reduce import FlashInferFusedAllReduce, fused_kernels_on_every_rank
    from dovetail_cuda.symm_mem_all_reduce import SymmMemAllReduce

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    distributed.init_tensor_parallel(world_size, rank, "nccl", f"tcp://127.0.0.1:{port}", device=device)
    group = distributed.tp_group()
    engine = SymmMemAllReduce(group, device)
    buffer = SymmMemAllReduce(group, device, max_bytes=max(sizes)).buffer
    one_shot = torch.ops.symm_mem.one_shot_all_reduce_copy_out
    two_shot = torch.ops.symm_mem.two_shot_all_reduce_out
    name = group.group_name

    def run_one_shot(x):
        one_shot(buffer[:x.numel()], x, "sum", name, x)

    def run_two_shot(x):
        staged = buffer[:x.numel()]
        staged.copy_(x)
        two_shot(staged, "sum", name, x)

    def run_engine(x):
        if not engine(x):
            dist.all_reduce(x)

    methods = {"nccl": dist.all_reduce, "one_shot": run_one_shot, "two_shot": run_two_shot, "engine": run_engine}
    fused = None
    if fused_kernels_on_every_rank(group) is None:
        fused = FlashInferFusedAllReduce(group, device, engine, max_bytes=max(sizes))
        forced = {f"fused_{kind}": FlashInferFusedAllReduce(group, device, engine, max_bytes=max(sizes),
                                                            one_shot=kind == "one_shot")
                  for kind in ("one_shot", "two_shot")}
    ops = TritonFusedOps()
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(torch.bfloat16)
    rows = []
    gen = torch.Generator(device=device).manual_seed(rank)
    for size in sizes:
        x = torch.randn(size // 2, generator=gen, device=device, dtype=torch.bfloat16)
        expected = x.clone()
        dist.all_reduce(expected)
        row = {"bytes": size}
        for method, fn in methods.items():
            got = x.clone()
            fn(got)
            error = float((got.float() - expected.float()).abs().max())
            if error > 0.05 * float(expected.float().abs().max()):
                raise AssertionError(f"{method} at {size} bytes differs from NCCL by {error}")
            work = x.clone()
            row[method] = time_graph(lambda i: fn(work), dist.barrier)
        if fused is not None and size % (2 * hidden) == 0:
            rows_of = x.view(-1, hidden)
            residual = torch.randn(rows_of.shape, generator=gen, device=device, dtype=torch.bfloat16)

            def steps(t):
                run_engine(t)
                return ops.add_rms_norm(t, residual, weight, 1e-6)

            want = steps(rows_of.clone())
            work = rows_of.clone()
            row["steps"] = time_graph(lambda i: steps(work), dist.barrier)
            for method, kernel in {"fused": fused, **forced}.items():
                got = kernel.add_rms_norm(rows_of.clone(), residual, weight, 1e-6)
                if got is None:  # the kernel does not take this message
                    continue
                for part, a, b in (("normed", got[0], want[0]), ("summed", got[1], want[1])):
                    error = float((a.float() - b.float()).abs().max())
                    if error > 0.05 * float(b.float().abs().max()):
                        raise AssertionError(f"{method} {part} at {size} bytes differs from the steps by {error}")
                row[method] = time_graph(lambda i, kernel=kernel: kernel.add_rms_norm(work, residual, weight, 1e-6),
                                         dist.barrier)
        rows.append(row)
    if rank == 0:
        results["rows"] = rows
    distributed.destroy_tensor_parallel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="message sizes in bytes (K, M suffixes)")
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size of the fused all-reduce + norm rows")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    if torch.cuda.device_count() < args.world_size:
        raise SystemExit(f"--world-size {args.world_size} needs as many GPUs; {torch.cuda.device_count()} visible")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.start_processes(_rank, args=(args.world_size, port, sizes, args.hidden, results), nprocs=args.world_size,
                       start_method="spawn")
    rows = results["rows"]
    methods = list(dict.fromkeys(k for row in rows for k in row if k != "bytes"))
    print(f"all-reduce of bfloat16 over {args.world_size} x {torch.cuda.get_device_name(0)}, "
          f"µs per call (GB/s of message)")
    print(f"{'bytes':>10} " + " ".join(f"{m:>20}" for m in methods))
    for row in rows:
        cells = [f"{row[m]:9.2f} ({row['bytes'] / row[m] / 1e3:7.1f})" if m in row else "-" for m in methods]
        print(f"{row['bytes']:>10} " + " ".join(f"{c:>20}" for c in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world_size": args.world_size, "gpu": torch.cuda.get_device_name(0), "hidden": args.hidden,
                       "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
