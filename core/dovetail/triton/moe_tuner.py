"""Timing the fused MoE's tile candidates on the GPU, once per layer shape (the results go to the disk cache).

For each token bucket it builds random tokens routed uniformly at random (as a
trained router spreads them), then for each ``block_m`` candidate aligns the pairs
once and times every gate/up and every down candidate with ``triton.testing.do_bench``;
the ``block_m`` whose two best GEMMs take the least time wins. A candidate that
does not compile on this GPU (too much shared memory) is skipped. Tuning
synchronises the device, so it runs before any graph is captured: the engine's
profiling pass and the warm-up of every graph size call the layer first.
"""

from __future__ import annotations

import logging
import time

import torch

from dovetail.triton.moe_align import align_pairs
from dovetail.triton.moe_configs import (LayerShape, MoeConfig, block_m_candidates, default_config,
                                         gemm_candidates)
from dovetail.triton.moe_gemm import GemmConfig, grouped_gemm, reads_through_descriptor

logger = logging.getLogger("dovetail")


def _time(fn) -> float:
    import triton.testing

    try:
        fn()
        return triton.testing.do_bench(fn, warmup=5, rep=25)
    except Exception as exc:  # a tile this GPU cannot run (shared memory, registers)
        logger.debug("fused MoE tuning: candidate skipped (%s: %s)", type(exc).__name__, exc)
        return float("inf")


def _best(candidates: list[GemmConfig], run) -> tuple[GemmConfig, float]:
    timed = [(_time(lambda c=c: run(c)), i) for i, c in enumerate(candidates)]
    ms, index = min(timed)
    return candidates[index], ms


def tune_bucket(tokens: int, shape: LayerShape, w13: torch.Tensor, w2: torch.Tensor, fp8) -> MoeConfig:
    """The fastest candidate configuration for ``tokens`` tokens of this layer."""
    device = w13.device
    gen = torch.Generator(device=device).manual_seed(tokens)
    act_dtype = getattr(torch, shape.dtype)
    x = torch.randn(tokens, shape.hidden, device=device, generator=gen).to(act_dtype)
    if shape.top_k <= shape.experts:
        ids = torch.rand(tokens, shape.experts, device=device, generator=gen).topk(shape.top_k, dim=-1).indices
    else:  # a rank holding fewer experts than a token picks (expert parallelism): picks repeat
        ids = torch.randint(0, shape.experts, (tokens, shape.top_k), device=device, generator=gen)
    ids = ids.to(torch.int32)
    pairs = tokens * shape.top_k
    block = None if fp8 is None else fp8.block_size
    if fp8 is not None:
        from dovetail.moe_ops import quantize_activations

        x, x_scale = quantize_activations(x, block)
        h, h_scale = quantize_activations(torch.randn(pairs, shape.inter, device=device).to(act_dtype), block)
    else:
        x_scale = h_scale = None
        h = torch.randn(pairs, shape.inter, device=device, generator=gen).to(act_dtype)
    up_out = torch.empty(pairs, shape.inter, dtype=act_dtype, device=device)
    down_out = torch.empty(pairs, shape.hidden, dtype=act_dtype, device=device)
    w13_scale = None if fp8 is None else fp8.w13
    w2_scale = None if fp8 is None else fp8.w2
    descriptors = fp8 is None and reads_through_descriptor(w13) and reads_through_descriptor(w2)
    best: tuple[float, MoeConfig] | None = None
    for block_m in block_m_candidates(tokens, shape):
        aligned = align_pairs(ids, shape.experts, block_m)
        up, up_ms = _best(gemm_candidates(block_m, True, descriptors), lambda c: grouped_gemm(
            x, w13, up_out, aligned, c, shape.top_k, gated=True, a_scale=x_scale, w_scale=w13_scale,
            block_size=block))
        down, down_ms = _best(gemm_candidates(block_m, False, descriptors), lambda c: grouped_gemm(
            h, w2, down_out, aligned, c, 1, a_scale=h_scale, w_scale=w2_scale, block_size=block))
        if best is None or up_ms + down_ms < best[0]:
            best = (up_ms + down_ms, MoeConfig(block_m, up, down))
    if best is None or best[0] == float("inf"):
        return default_config(tokens, shape)
    return best[1]


def tune(buckets: list[int], shape: LayerShape, w13: torch.Tensor, w2: torch.Tensor, fp8) -> dict[int, MoeConfig]:
    """Tuned configurations of ``buckets`` (token counts) for this layer shape; a bucket whose tuning failed is
    left out (its caller runs the defaults)."""
    started = time.perf_counter()
    logger.info("fused MoE: tuning tiles for %s at %d token counts (once per GPU kind; cached on disk)",
                shape, len(buckets))
    configs = {}
    for tokens in buckets:
        try:
            configs[tokens] = tune_bucket(tokens, shape, w13, w2, fp8)
        except Exception as exc:  # tuning is an optimisation: the defaults still compute the layer
            logger.warning("fused MoE: tuning %d tokens failed (%s: %s); using the default tiles", tokens,
                           type(exc).__name__, exc)
        else:
            logger.info("fused MoE: %d tokens: %s", tokens, configs[tokens].describe())
    logger.info("fused MoE: tuned in %.1f s", time.perf_counter() - started)
    return configs
