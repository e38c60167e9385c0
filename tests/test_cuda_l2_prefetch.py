"""The CUDA plugin's L2 prefetch of the next product's weight beside a tensor-parallel sum
(``dovetail_cuda.l2_prefetch``).

Without a GPU: the size variable is validated and nothing is prefetched outside a CUDA-graph capture or for
tensors off the GPU (the kernel's sm_90 compile is in tests/test_triton_compile.py). With a Hopper GPU: a
captured prefetch forks and joins its side stream, and the products replayed beside it are exact.
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


def test_nothing_is_prefetched_outside_a_capture_or_off_the_gpu():
    prefetch = l2_prefetch.L2Prefetch(torch.device("cpu"), max_bytes=1 << 20)
    assert prefetch.max_bytes == 0  # no device to prefetch on
    assert not prefetch.start(torch.randn(64, 64))
    prefetch.max_bytes = 1 << 20
    assert not prefetch.start(torch.randn(64, 64))  # a CPU tensor
    assert not prefetch.start(None)


@pytest.mark.gpu
def test_a_captured_prefetch_leaves_the_products_exact():
    device = torch.device("cuda", 0)
    if torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("the bulk L2 prefetch needs sm_90 or newer")
    gen = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(4096, 2048, device=device, dtype=torch.bfloat16, generator=gen)
    x = torch.randn(64, 2048, device=device, dtype=torch.bfloat16, generator=gen)
    prefetch = l2_prefetch.L2Prefetch(device, max_bytes=8 << 20)
    assert not prefetch.start(weight)  # not capturing
    l2_prefetch.prefetch_into_l2(weight, 8 << 20)  # outside graphs the kernel runs too
    out = x @ weight.T
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        started = prefetch.start(weight)
        out.copy_(x @ weight.T)
        restarted = prefetch.start(weight)  # joins the first
        prefetch.join()  # a capture must end joined
    assert started and restarted and not prefetch._pending
    for _ in range(3):
        x.copy_(torch.randn(x.shape, device=device, dtype=x.dtype, generator=gen))
        graph.replay()
        torch.testing.assert_close(out, x @ weight.T, rtol=0, atol=0)
