"""Registers and spills of the paged-attention kernel as the GPU's compiler built it, one line per variant.

Runs the TRITON backend's decode launches at llama-3.1-8b's and qwen3-0.6b's head shapes (B1-like batches of
256 and batch-1 splits; plain ``forward``, and ``forward_rotary`` with and without per-head norms), then
prints each compiled variant's switches with its register count and spilled bytes: a spill inside the key
loop costs bandwidth. Needs a GPU; ``python3 benchmarks/triton_kernel_registers.py``.
"""

from __future__ import annotations

import json
import random

import torch

from dovetail.attention.backend import AttentionLayerSpec, RotaryInputs
from dovetail.attention.batch import AttentionBatch
from dovetail.attention.triton_backend import TritonAttentionImpl, TritonMetadataBuilder, TritonBackend
from dovetail.layers.rotary import compute_cos_sin_cache
from dovetail.triton import paged_attention

SWITCHES = ("DECODE_ONLY", "SPLIT_KV", "NEW_KV", "ROTARY_HALF", "QK_NORM", "HEADS_FASTEST", "ORDERED", "BLOCK_M",
            "TILE_N", "QUERIES_PER_KV")


def decode_batch(num_seqs: int, seed: int, block_size: int = 16) -> AttentionBatch:
    rng = random.Random(seed)
    seq_lens = [rng.randint(100, 2048) for _ in range(num_seqs)]
    tables, next_block = [], 0
    for s in seq_lens:
        blocks = -(-s // block_size)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    return AttentionBatch.from_lists([1] * num_seqs, seq_lens, tables, block_size, "cuda")


def run(num_heads: int, num_kv_heads: int, num_seqs: int, rotary: str | None) -> None:
    head_size = 128
    spec = AttentionLayerSpec(num_heads, num_kv_heads, head_size, head_size ** -0.5)
    batch = decode_batch(num_seqs, seed=num_seqs)
    metadata = TritonMetadataBuilder(TritonBackend, [spec], 16, torch.device("cuda"), torch.bfloat16).build(batch)
    blocks = int(batch.block_table.max()) + 1
    q = torch.randn(num_seqs, num_heads, head_size, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(num_seqs, num_kv_heads, head_size, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cache = torch.randn(2, blocks, 16, num_kv_heads, head_size, device="cuda", dtype=torch.bfloat16)
    impl = TritonAttentionImpl(spec)
    if rotary is None:
        impl.forward(q, k, v, cache, metadata)
        return
    table = compute_cos_sin_cache(head_size, 4096, {"rope_theta": 500000.0, "rope_type": "default"}, 4096).cuda()
    weights = {}
    if rotary == "qk_norm":
        weights = dict(q_norm_weight=torch.ones(head_size, device="cuda", dtype=torch.bfloat16),
                       k_norm_weight=torch.ones(head_size, device="cuda", dtype=torch.bfloat16))
    inputs = RotaryInputs(batch.seq_lens.long() - 1, table, head_size, apply=None, eps=1e-6, **weights)
    impl.forward_rotary(q, k, v, cache, metadata, inputs)


def main() -> None:
    for num_heads, num_kv_heads in ((32, 8), (16, 8)):
        for num_seqs in (256, 1):
            for rotary in (None, "rotary", "qk_norm"):
                run(num_heads, num_kv_heads, num_seqs, rotary)
    torch.cuda.synchronize()
    kernel = paged_attention._paged_attention_kernel
    for device_cache in kernel.device_caches.values():
        for compiled in device_cache[0].values():
            constants = getattr(compiled.src, "constants", {}) if hasattr(compiled, "src") else {}
            names = {kernel.arg_names[key[0]] if isinstance(key, tuple) else key: value
                     for key, value in constants.items()}
            print(json.dumps({**{name: names.get(name) for name in SWITCHES},
                              "n_regs": getattr(compiled, "n_regs", None), "n_spills": getattr(compiled, "n_spills", None)}))


if __name__ == "__main__":
    main()
