"""The CUDA plugin's L2 prefetch of the next product's weight before a tensor-parallel sum
(``dovetail_cuda.l2_prefetch``).

Without a GPU: the size variable is validated, each row's prefix is sized to the budget, and nothing is
prefetched outside a CUDA-graph capture or for tensors off the GPU (the kernel's sm_90 compile is in
tests/test_triton_compile.py). With a Hopper GPU: a captured prefetch before a product leaves it exact.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("dovetail_cuda")
pytest.importorskip("triton")

from dovetail.errors import ConfigError  # noqa: E402
from dovetail_cuda import l2_prefetch  # noqa: E402


def test_the_prefetch_size_is_whole_megabytes(monkeypatch):
    monkeypatch.delenv(l2_prefetch.ENV, raising=False)
    assert l2_prefetch.prefetch_mb() == l2_prefetch.DEFAULT_MB
    monkeypatch.setenv(l2_prefetch.ENV, "0")
    assert l2_prefetch.prefetch_mb() == 0
    monkeypatch.setenv(l2_prefetch.ENV, "1.5")
    with pytest.raises(ConfigError, match=f"{l2_prefetch.ENV}='1.5': expected a whole number of megabytes"):
        l2_prefetch.prefetch_mb()


def test_each_rows_prefix_fits_the_budget_in_whole_units():
    weight = torch.empty(25600, 5120, dtype=torch.bfloat16)  # a TP=2 rank's gate/up of qwen3-32b
    prefix = l2_prefetch.row_prefix_bytes(weight, 8 << 20)
    assert prefix == 320 and prefix * weight.shape[0] <= 8 << 20  # 327.68 bytes a row, in 16-byte units
    small = torch.empty(64, 256, dtype=torch.bfloat16)  # rows of 512 bytes: the whole row, not more
    assert l2_prefetch.row_prefix_bytes(small, 8 << 20) == 512
    assert l2_prefetch.row_prefix_bytes(weight, 1 << 20) == 0  # 40 bytes a row: under a line, not worth it
    assert l2_prefetch.row_prefix_bytes(weight.t(), 8 << 20) == 0  # rows not contiguous
    assert l2_prefetch.row_prefix_bytes(torch.empty(8, dtype=torch.bfloat16), 8 << 20) == 0


def test_nothing_is_prefetched_outside_a_capture_or_off_the_gpu():
    prefetch = l2_prefetch.L2Prefetch(torch.device("cpu"), max_bytes=1 << 20)
    assert prefetch.max_bytes == 0  # no device to prefetch on
    assert not prefetch.before(torch.randn(64, 64))
    prefetch.max_bytes = 1 << 20
    assert not prefetch.before(torch.randn(64, 64))  # a CPU tensor
    assert not prefetch.before(None)


@pytest.mark.gpu
def test_a_captured_prefetch_leaves_the_products_exact():
    device = torch.device("cuda", 0)
    if torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("the bulk L2 prefetch needs sm_90 or newer")
    gen = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(4096, 2048, device=device, dtype=torch.bfloat16, generator=gen)
    x = torch.randn(64, 2048, device=device, dtype=torch.bfloat16, generator=gen)
    prefetch = l2_prefetch.L2Prefetch(device, max_bytes=4 << 20)
    assert not prefetch.before(weight)  # not capturing
    assert l2_prefetch.prefetch_row_prefixes(weight, 4 << 20)  # outside graphs the kernel runs too
    out = x @ weight.T
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        started = prefetch.before(weight)
        out.copy_(x @ weight.T)
    assert started
    for _ in range(3):
        x.copy_(torch.randn(x.shape, device=device, dtype=x.dtype, generator=gen))
        graph.replay()
        torch.testing.assert_close(out, x @ weight.T, rtol=0, atol=0)
