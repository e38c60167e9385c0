"""Probe: does prefetching the next linear's weights into L2 during an idle window (an all-reduce stand-in:
torch.cuda._sleep) speed the next GEMM? qwen3-32b TP=2 rank shapes, cuBLAS GEMMs, CUDA graphs."""
import statistics, sys, json
import torch, triton, triton.language as tl
import torch.nn.functional as F

@triton.jit
def _prefetch_kernel(base_ptr, stride_bytes, seg_bytes, n_segs, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n_segs
    addr = base_ptr + tl.where(ok, i, 0).to(tl.int64) * stride_bytes
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
        "=r,l,r,r", [addr, ok.to(tl.int32), seg_bytes + tl.zeros_like(i)], dtype=tl.int32, is_pure=False, pack=1)

def prefetch(w, nbytes, mode):
    if nbytes <= 0: return
    b = w.view(torch.uint8).view(-1)
    row = w.shape[1] * w.element_size()
    if mode == "rows":
        seg = 16384; n = min(nbytes, b.numel()) // seg; stride = seg
    else:  # slab: the first part of every row
        frac = min(1.0, nbytes / b.numel()); seg = max(16, int(row * frac) // 16 * 16); n = w.shape[0]; stride = row
    _prefetch_kernel[(triton.cdiv(n, 128),)](b, stride, seg, n, BLOCK=128, num_warps=4)

H, L = 5120, 8
shapes = {"qkv": (4608 + 512 * 0, 5120), "o": (5120, 4096), "gu": (25600, 5120), "d": (5120, 12800)}
dev = "cuda"
W = [{k: torch.randn(n, kk, device=dev, dtype=torch.bfloat16) * 0.02 for k, (n, kk) in shapes.items()} for _ in range(L)]
side = torch.cuda.Stream()
cycles_per_us = torch.cuda.get_device_properties(0).clock_rate / 1000  # kHz -> cycles per us

def run_layers(xs, sleep_us, pbytes, mode, pf_gemm=False):
    evs = []
    for l in range(L):
        w = W[l]; nxt = W[(l + 1) % L]
        F.linear(xs[5120], w["qkv"])
        F.linear(xs[4096], w["o"])
        if pbytes:
            e = torch.cuda.Event(); e.record(); side.wait_event(e)
            with torch.cuda.stream(side): prefetch(w["gu"], pbytes, mode)
        if sleep_us: torch.cuda._sleep(int(sleep_us * cycles_per_us))
        F.linear(xs[5120], w["gu"])
        F.linear(xs[12800], w["d"])
        if pbytes:
            e = torch.cuda.Event(); e.record(); side.wait_event(e)
            with torch.cuda.stream(side): prefetch(nxt["qkv"], pbytes, mode)
        if sleep_us: torch.cuda._sleep(int(sleep_us * cycles_per_us))
    if pbytes:
        e = torch.cuda.Event(); e.record(side); torch.cuda.current_stream().wait_event(e)

def timed(fn):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g): fn()
    g.replay(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = []
    for _ in range(15):
        s.record(); g.replay(); e.record(); e.synchronize(); t.append(s.elapsed_time(e) * 1000 / L)
    return statistics.median(t)

res = {}
for m in [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "1,32,128,256").split(",")]:
    xs = {k: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for k in (4096, 5120, 12800)}
    row = {}
    row["gemms"] = timed(lambda: run_layers(xs, 0, 0, "rows"))
    for sl in (6, 12):
        row[f"sleep{sl}"] = timed(lambda: run_layers(xs, sl, 0, "rows"))
        for mb in (8, 16, 32):
            for mode in ("rows", "slab"):
                row[f"sleep{sl} pf{mb}MB {mode}"] = timed(lambda: run_layers(xs, sl, mb << 20, mode))
    for mb in (16,):
        row[f"nosleep pf{mb}MB rows"] = timed(lambda: run_layers(xs, 0, mb << 20, "rows"))
    res[m] = row
    base = row["gemms"]
    print(f"M={m}: " + " | ".join(f"{k} {v:.1f}us ({v - base:+.1f})" for k, v in row.items()), flush=True)
json.dump(res, open(sys.argv[2] if len(sys.argv) > 2 else "l2_prefetch_probe.json", "w"), indent=1)
