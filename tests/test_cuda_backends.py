"""CUDA attention backends against REFERENCE on random inputs, eagerly and replayed from CUDA graphs (GPU)."""

from __future__ import annotations

import random

import pytest
import torch

from dovetail import testing
from dovetail.attention.backend import AttentionLayerSpec
from dovetail.attention.batch import AttentionBatch
from dovetail.attention.reference import ReferenceBackend
from dovetail.engine.model_runner import block_table_tensor
from installed_backends import installed_attention_backend

pytestmark = pytest.mark.gpu

BACKENDS = ["FLASHINFER", "TRITON", "FLASH_ATTN"]
# Each (dtype, head size, window, soft-cap) combination is a FlashInfer JIT build: keep the set small.
CASES = (testing.attention_cases(head_sizes=(64, 128), block_sizes=(16, 32))
         + [testing.AttentionCase("prefill-h256", ((0, 70), (0, 3)), 256, 8, 2, 16),
            testing.AttentionCase("decode-h256", ((90, 1), (1, 1), (16, 1)), 256, 8, 2, 16)])


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("name", BACKENDS)
def test_backend_matches_reference(name, case):
    backend = installed_attention_backend(name)
    try:
        testing.check_attention_case(backend, case, device="cuda", dtype=torch.bfloat16, platform="cuda")
    except testing.NotApplicable as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("name", BACKENDS)
def test_negative_slots_are_not_written(name):
    backend = installed_attention_backend(name)
    spec = AttentionLayerSpec(8, 2, 128, 128 ** -0.5)
    batch = AttentionBatch.build([1, 1, 5], [9, 20, 5], [[3], [4, 5], [6]], [3 * 16 + 8, -1, -1, 6 * 16, 6 * 16 + 1,
                                                                              6 * 16 + 2, 6 * 16 + 3], 16, "cuda")
    q, k, v = (torch.randn(7, h, 128, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
    cache = torch.randn(2, 8, 16, 2, 128, device="cuda", dtype=torch.bfloat16)
    before = cache.clone()
    builder = backend.metadata_builder_cls()(backend, [spec], 16, torch.device("cuda"), torch.bfloat16)
    backend.impl_cls()(spec).forward(q, k, v, cache, builder.build(batch))
    assert torch.equal(cache[:, 4:6], before[:, 4:6]), "slot -1 must not be written"
    assert torch.equal(cache[:, 3, 8], torch.stack([k[0], v[0]]))


class _StaticDecode:
    """Static buffers for a decode batch of ``size`` sequences, filled as the model runner fills them."""

    def __init__(self, size, width, spare, block_size=16):
        self.size, self.block_size, self.spare = size, block_size, spare
        self.slots = torch.zeros(size, dtype=torch.long, device="cuda")
        self.seq_lens = torch.ones(size, dtype=torch.int32, device="cuda")
        self.qsl = torch.arange(size + 1, dtype=torch.int32, device="cuda")
        self.table = torch.full((size, width), spare, dtype=torch.int32, device="cuda")

    def load(self, seq_lens, tables):
        bs = self.block_size
        host_table = block_table_tensor(tables, fill=self.spare)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        slots = host_table[torch.arange(self.size), (lens.long() - 1) // bs].long() * bs + (lens.long() - 1) % bs
        self.slots.copy_(slots)
        self.seq_lens.copy_(lens)
        self.table[:, :host_table.shape[1]].copy_(host_table)
        return AttentionBatch(self.size, self.size, self.size, 1, 4096, self.qsl, self.seq_lens, self.table,
                              self.slots, torch.arange(self.size + 1, dtype=torch.int32), lens, bs, host_table)


@pytest.mark.parametrize("name", BACKENDS)
def test_captured_decode_replays_new_lengths(name):
    """Capture one layer's decode at length 1, replay it on longer, different sequences."""
    backend = installed_attention_backend(name)
    if not backend.supports_graph_capture:
        pytest.skip(f"{name} does not capture graphs")
    size, bs, num_blocks = 8, 16, 600
    spec = AttentionLayerSpec(32, 8, 128, 128 ** -0.5)
    cache = torch.randn(2, num_blocks + 1, bs, 8, 128, device="cuda", dtype=torch.bfloat16)
    static = _StaticDecode(size, 4096 // bs, spare=num_blocks)
    q, k, v = (torch.zeros(size, h, 128, device="cuda", dtype=torch.bfloat16) for h in (32, 8, 8))
    builder = backend.metadata_builder_cls()(backend, [spec], bs, torch.device("cuda"), torch.bfloat16)
    impl = backend.impl_cls()(spec)
    metadata = builder.build_for_graph(static.load([1] * size, [[num_blocks]] * size), size)
    impl.forward(q, k, v, cache, metadata)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = impl.forward(q, k, v, cache, metadata)
    rng = random.Random(0)
    for lengths in ([5, 700, 33, 1, 16, 17, 250, 2000], [3000, 2, 64, 65, 128, 900, 1, 4000]):
        blocks = list(range(num_blocks))
        rng.shuffle(blocks)
        tables = [[blocks.pop() for _ in range(-(-n // bs))] for n in lengths]
        batch = static.load(lengths, tables)
        builder.build_for_graph(batch, size)
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        ref_cache = cache.clone()
        graph.replay()
        ref = ReferenceBackend.impl_cls()(spec).forward(q, k, v, ref_cache, batch)
        diff = (out.float() - ref.float()).abs().max().item()
        assert diff < 3e-2, f"{name} replay differs from REFERENCE by {diff} for lengths {lengths}"
        assert torch.equal(cache, ref_cache), f"{name} replay wrote the cache differently"
