"""The fused mixture-of-experts of GPU platforms: align, gate/up GEMM with the activation, down GEMM, weighted sum.

:func:`fused_moe` equals :func:`dovetail.moe_ops.moe_reference` (within the dtype's
rounding) and runs as four kernels per pass of up to
:data:`~dovetail.triton.moe_configs.MAX_CHUNK_TOKENS` tokens (:mod:`~dovetail.triton.moe_align`,
then :mod:`~dovetail.triton.moe_gemm`'s gate/up, down and sum; FP8 experts add
the quantization of each GEMM's input); a single token (batch-1 decode) needs no
alignment, its ``top_k`` experts being distinct. :func:`routed_moe` takes the router's logits
instead of the chosen experts and routes in the alignment's kernels, so routing costs no launch of its
own (but for one token, which needs no alignment). No value computed on the device is read on the
host and every buffer's size follows from the token count, so a decode step is captured by device
graphs as it is. Tiles come from :mod:`~dovetail.triton.moe_configs`. With ``unsummed`` a layer of one
pass returns its pairs' outputs before the weighted sum (:class:`~dovetail.moe_ops.ExpertOutputs`), which
the norm after it sums in its own launch (:func:`dovetail.triton.norm.rms_norm`).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from dovetail.moe_ops import ExpertOutputs, Fp8ExpertScales, check_activation, quantize_activations
from dovetail.triton import interpreter_active
from dovetail.triton.moe_align import align_pairs, one_pair_per_block, route_and_align
from dovetail.triton.moe_configs import (MAX_CHUNK_TOKENS, ConfigTable, LayerShape, MoeConfig, bucket, buckets_up_to,
                                         default_config)
from dovetail.triton.moe_gemm import GemmConfig, grouped_gemm, moe_sum, reads_through_descriptor
from dovetail.triton.moe_routing import topk_softmax

logger = logging.getLogger("dovetail")


def supports(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
             fp8: Fp8ExpertScales | None) -> bool:
    """Whether :func:`fused_moe` takes these operands (contiguous 2-D tokens, stacked experts with unit stride
    over their inputs, 16/32-bit activations, FP8 block scales of whole GEMM tiles)."""
    if not (x.dim() == 2 and x.shape[0] > 0 and x.stride(-1) == 1 and topk_ids.dim() == 2
            and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and w13.dim() == 3 and w2.dim() == 3 and w13.stride(-1) == 1 and w2.stride(-1) == 1
            and w13.shape[0] == w2.shape[0] > 0 and w13.shape[1] == 2 * w2.shape[2] and w13.shape[2] == x.shape[1]
            and w2.shape[1] == x.shape[1]):
        return False
    if fp8 is None:
        return w13.dtype == x.dtype and w2.dtype == x.dtype
    if fp8.block_size is not None:
        bn, bk = fp8.block_size
        if bk < 16 or bk & (bk - 1) or w2.shape[2] % bn:
            return False
    return w13.dtype == w2.dtype and w13.element_size() == 1 and x.dtype != torch.float32


def layer_shape(x: torch.Tensor, w13: torch.Tensor, top_k: int, fp8: Fp8ExpertScales | None) -> LayerShape:
    quant = "none"
    if fp8 is not None:
        quant = "fp8" if fp8.block_size is None else "fp8-b{}x{}".format(*fp8.block_size)
    return LayerShape(w13.shape[0], w13.shape[1] // 2, w13.shape[2], top_k, str(x.dtype).removeprefix("torch."),
                      quant)


@functools.lru_cache(maxsize=None)
def _table(device_key: str) -> ConfigTable:
    return ConfigTable(device_key)


@functools.lru_cache(maxsize=None)
def _device_key(device: torch.device) -> str:
    """The GPU kind, as triton's driver names it (backend, architecture, multiprocessors), and triton's version."""
    import triton
    from triton.runtime import driver

    target = driver.active.get_current_target()
    try:
        index = device.index if device.index is not None else driver.active.get_current_device()
        units = driver.active.utils.get_device_properties(index).get("multiprocessor_count", 0)
    except Exception:  # a driver without device properties
        units = 0
    return f"{target.backend}-{target.arch}-{units}sm-triton{triton.__version__}"


def tuning_enabled(device: torch.device) -> bool:
    """Whether tiles are timed on this device: a GPU run by triton's compiled kernels, unless ``DOVETAIL_MOE_TUNE=0``."""
    return (device.type != "cpu" and not interpreter_active()
            and os.environ.get("DOVETAIL_MOE_TUNE", "1").strip() not in ("0", "false", "no"))


def select_config(tokens: int, shape: LayerShape, w13: torch.Tensor, w2: torch.Tensor,
                  fp8: Fp8ExpertScales | None) -> MoeConfig:
    """The configuration for ``tokens`` tokens: tuned (tuning every missing bucket up to this one the first time,
    when tuning is on), else :func:`~dovetail.triton.moe_configs.default_config`."""
    if not tuning_enabled(w13.device):
        return default_config(tokens, shape)
    table = _table(_device_key(w13.device))
    configs = table.get(shape)
    wanted = bucket(tokens)
    if wanted not in configs:
        from dovetail.triton.moe_tuner import tune

        missing = [b for b in buckets_up_to(tokens) if b not in configs]
        tuned = tune(missing, shape, w13, w2, fp8)
        table.store(shape, tuned, {b: default_config(b, shape) for b in missing if b not in tuned})
    return configs[wanted]


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu", expert_map: torch.Tensor | None = None,
              fp8: Fp8ExpertScales | None = None, config: MoeConfig | None = None) -> torch.Tensor:
    """The mixture-of-experts MLPs of ``x`` (see :meth:`dovetail.ops.FusedOps.fused_moe`); ``config`` overrides
    the tile selection (tests, benchmarks)."""
    def route(start: int, end: int, block_m: int):
        ids = topk_ids[start:end]
        if end - start == 1:
            return topk_weights[start:end], ids, one_pair_per_block(ids, block_m, expert_map)
        return topk_weights[start:end], ids, align_pairs(ids, w13.shape[0], block_m, expert_map)

    return _run(x, w13, w2, topk_ids.shape[1], route, activation, fp8, config, expert_map)


def routed_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
               renormalize: bool, activation: str = "silu", expert_map: torch.Tensor | None = None,
               fp8: Fp8ExpertScales | None = None, config: MoeConfig | None = None,
               unsummed: bool = False) -> torch.Tensor | ExpertOutputs:
    """:func:`~dovetail.triton.moe_routing.topk_softmax` of ``router_logits``, then :func:`fused_moe`, with the
    routing computed by the alignment's kernels (:func:`~dovetail.triton.moe_align.route_and_align`): one launch
    fewer per layer (see :meth:`dovetail.ops.FusedOps.routed_moe`). ``unsummed``: the pairs' outputs before
    their weighted sum, where the layer is one pass without an ``expert_map`` (module docstring)."""
    def route(start: int, end: int, block_m: int):
        logits = router_logits[start:end]
        if end - start == 1:
            weights, ids = topk_softmax(logits, top_k, renormalize)
            return weights, ids, one_pair_per_block(ids, block_m, expert_map)
        return route_and_align(logits, top_k, renormalize, w13.shape[0], block_m, expert_map)

    unsummed = unsummed and expert_map is None and 0 < x.shape[0] <= MAX_CHUNK_TOKENS
    return _run(x, w13, w2, top_k, route, activation, fp8, config, expert_map, unsummed)


def _run(x, w13, w2, top_k: int, route, activation: str, fp8, config: MoeConfig | None, expert_map,
         unsummed: bool = False) -> torch.Tensor | ExpertOutputs:
    """The layer in passes of up to ``MAX_CHUNK_TOKENS`` tokens; ``route(start, end, block_m)`` gives each pass's
    weights, expert ids and aligned pairs. ``unsummed``: one pass, whose pairs' outputs are returned unsummed."""
    check_activation(activation)
    tokens = x.shape[0]
    shape = layer_shape(x, w13, top_k, fp8)
    out = None if unsummed else torch.empty_like(x)
    for start in range(0, tokens, MAX_CHUNK_TOKENS):
        end = min(tokens, start + MAX_CHUNK_TOKENS)
        chosen = config or select_config(end - start, shape, w13, w2, fp8)
        weights, ids, aligned = route(start, end, chosen.block_m)
        pairs = _fused_pass(x[start:end], w13, w2, weights, ids, aligned, activation, expert_map, fp8, chosen)
        if unsummed:
            return ExpertOutputs(pairs, weights)
        moe_sum(pairs, weights, out[start:end], ids, expert_map)
    return out


def _fused_pass(x, w13, w2, topk_weights, topk_ids, aligned, activation, expert_map, fp8,
                config: MoeConfig) -> torch.Tensor:
    """The outputs of the pass's (token, expert) pairs, ``[tokens * top_k, hidden]``."""
    tokens, top_k = topk_ids.shape
    pairs = tokens * top_k
    inter, hidden = w2.shape[2], w2.shape[1]
    block = fp8.block_size if fp8 is not None else None
    a, a_scale = (x, None) if fp8 is None else quantize_activations(x, block)
    hidden_states = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    _gemm(a, w13, hidden_states, aligned, config.up, top_k, gated=True, gelu_tanh=activation != "silu",
          a_scale=a_scale, w_scale=None if fp8 is None else fp8.w13, block_size=block)
    h, h_scale = (hidden_states, None) if fp8 is None else quantize_activations(hidden_states, block)
    expert_out = torch.empty((pairs, hidden), dtype=x.dtype, device=x.device)
    _gemm(h, w2, expert_out, aligned, config.down, 1, a_scale=h_scale, w_scale=None if fp8 is None else fp8.w2,
          block_size=block)
    return expert_out


def _gemm(a, weight, out, aligned, config: GemmConfig, a_row_div: int, **options) -> None:
    """:func:`grouped_gemm`, retried with fewer pipeline stages where the GPU lacks the shared memory. A tile
    tuned to read its weights through a tensor descriptor reads them by address where this weight cannot be
    (the table holds one layer shape's tiles, whatever tensors of that shape they were tuned on)."""
    if config.tma and not reads_through_descriptor(weight):
        config = config._replace(tma=False)
    try:
        grouped_gemm(a, weight, out, aligned, config, a_row_div, **options)
    except Exception as exc:
        if type(exc).__name__ != "OutOfResources" or config.num_stages <= 2:
            raise
        logger.warning("fused MoE: tile %s does not fit this GPU (%s); running it with 2 stages", config, exc)
        grouped_gemm(a, weight, out, aligned, config._replace(num_stages=2), a_row_div, **options)
