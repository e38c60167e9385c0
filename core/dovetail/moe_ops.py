"""Mixture-of-experts math in plain torch: routing, the definition, and the CPU's grouped path.

:class:`dovetail.ops.FusedOps` calls these (``select_experts`` and ``fused_moe``);
platforms override them with kernels (the core's Triton MoE for GPUs) that must
match :func:`moe_reference`. The layer that owns the weights is
:class:`dovetail.layers.moe.FusedMoE`. This module imports nothing of the
engine, so that the ops and the layers both build on it without an import cycle.

Conventions shared by every implementation:

- ``w13`` ``[experts, 2 * inter, hidden]``: each expert's gate rows, then its up
  rows; ``w2`` ``[experts, hidden, inter]``.
- ``topk_weights`` float32 and ``topk_ids`` (int32 or int64) ``[tokens, top_k]``
  name *global* expert ids. ``expert_map`` (int32 ``[global experts]``, optional)
  turns them into rows of ``w13``/``w2`` (the experts this rank holds) and is
  ``-1`` for an expert held elsewhere: such a choice adds nothing to the token.
- FP8 experts (:class:`Fp8ExpertScales`): ``w13``/``w2`` are ``float8_e4m3fn``;
  activations are quantized dynamically before each product, per token (per-channel
  weight scales) or per token and ``block_size[1]`` features (block scales).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dovetail.quantization import quant_ops

#: Gated activations the experts support, by HF ``hidden_act`` name.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class Fp8ExpertScales:
    """Scales of FP8 (e4m3) expert weights: ``w = w_fp8 * scale``.

    - ``block_size`` None: one scale per output channel, ``w13`` ``[experts, 2 * inter]``
      and ``w2`` ``[experts, hidden]`` (per-tensor checkpoints repeat their scale).
    - ``block_size`` ``(bn, bk)``: one scale per block of ``bn`` output channels and
      ``bk`` input features, ``[experts, ceil(N / bn), ceil(K / bk)]`` (Qwen's and
      DeepSeek's FP8 checkpoints, 128 x 128).
    """

    w13: torch.Tensor
    w2: torch.Tensor
    block_size: tuple[int, int] | None = None


@dataclass(frozen=True)
class ExpertOutputs:
    """A mixture of experts' output before its weighted sum, which the norm after the layer takes in its own
    kernel (:meth:`dovetail.ops.FusedOps.add_rms_norm_experts`).

    ``pairs`` ``[tokens * top_k, hidden]``: row ``t * top_k + j`` is token ``t`` through its ``j``-th expert;
    ``weights`` float32 ``[tokens, top_k]``. The layer's output is :meth:`summed`.
    """

    pairs: torch.Tensor
    weights: torch.Tensor

    def summed(self) -> torch.Tensor:
        """``sum_j weights[t, j] * pairs[t * top_k + j]`` in float32, in the pairs' dtype."""
        tokens, top_k = self.weights.shape
        rows = self.pairs.view(tokens, top_k, -1).float() * self.weights.unsqueeze(-1)
        return rows.sum(1).to(self.pairs.dtype)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` experts of each token and their weights, as HF routes (softmax in float32 first).

    Returns float32 weights ``[tokens, top_k]`` (renormalized to sum to 1 when
    ``renormalize``: HF's ``norm_topk_prob``, always on for Mixtral) and int64 expert
    ids ``[tokens, top_k]``.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def check_activation(activation: str) -> None:
    """Raise ``ValueError`` naming the supported activations when ``activation`` is not one."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not supported by the MoE layer "
                         f"(supported: {', '.join(ACTIVATIONS)})")


def act_and_mul(h: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` over ``h = [..., gate | up]``."""
    check_activation(activation)
    gate, up = h.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh") * up


def local_expert_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Rows of ``w13``/``w2`` for ``topk_ids`` (int64): ``expert_map[topk_ids]``, ``-1`` where not held here."""
    ids = topk_ids.long()
    return ids if expert_map is None else expert_map.to(ids.device).long()[ids]


def dequantize_experts(weight: torch.Tensor, scale: torch.Tensor,
                       block_size: tuple[int, int] | None) -> torch.Tensor:
    """Float32 ``[experts, N, K]`` from FP8 expert weights and their per-channel or block scales."""
    return torch.stack([quant_ops.dequantize_fp8_weight(weight[e], scale[e], block_size)
                        for e in range(weight.shape[0])]) if weight.shape[0] else weight.float()


def quantize_activations(x: torch.Tensor, block_size: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 ``x`` and its float32 scales, as the experts quantize their inputs: per token (``[M, 1]``), or per
    token and ``block_size[1]`` features (``[M, ceil(K / bk)]``)."""
    return quant_ops.quantize_fp8_per_token(x, None if block_size is None else block_size[1])


def _fake_quantize(x: torch.Tensor, block_size: tuple[int, int] | None) -> torch.Tensor:
    """Float32 values of ``x`` after the experts' activation quantization (quantized, then scaled back)."""
    q, scale = quantize_activations(x, block_size)
    if block_size is None:
        return q.float() * scale
    return quant_ops.dequantize_per_group(q, scale, block_size[1])


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str = "silu", expert_map: torch.Tensor | None = None,
                  fp8: Fp8ExpertScales | None = None) -> torch.Tensor:
    """The definition: ``out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])``.

    Every expert runs on every token, densely (slow; for tests), where
    ``expert_e(x) = w2[e] @ act_and_mul(w13[e] @ x)``; a choice whose expert
    ``expert_map`` marks ``-1`` adds nothing. FP8 experts run on their dequantized
    weights and on activations quantized as the kernels quantize them, in float32,
    each stage's result rounded to ``x``'s dtype. Returns ``x``'s shape and dtype.
    """
    ids = local_expert_ids(topk_ids, expert_map)
    held = ids >= 0
    if fp8 is None:
        hidden = act_and_mul(torch.einsum("th,eih->tei", x, w13), activation)  # [tokens, experts, inter]
        per_expert = torch.einsum("tei,ehi->teh", hidden, w2)  # [tokens, experts, hidden]
    else:
        w13f = dequantize_experts(w13, fp8.w13, fp8.block_size)
        w2f = dequantize_experts(w2, fp8.w2, fp8.block_size)
        xq = _fake_quantize(x, fp8.block_size)
        hidden = act_and_mul(torch.einsum("th,eih->tei", xq, w13f), activation).to(x.dtype)
        hq = _fake_quantize(hidden.flatten(0, 1), fp8.block_size).unflatten(0, hidden.shape[:2])
        per_expert = torch.einsum("tei,ehi->teh", hq, w2f).to(x.dtype)
    gather = ids.clamp(min=0).unsqueeze(-1).expand(-1, -1, x.shape[-1])
    chosen = per_expert.gather(1, gather)  # [tokens, top_k, hidden]
    weights = torch.where(held, topk_weights.float(), torch.zeros((), device=x.device))
    return (chosen.float() * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str = "silu", expert_map: torch.Tensor | None = None,
                  fp8: Fp8ExpertScales | None = None) -> torch.Tensor:
    """All experts in one pass: the (token, expert) pairs sorted by expert, one matmul pair per expert hit.

    Only the selected experts run, each on the contiguous block of its tokens;
    the weighted results are summed back per token. Matches :func:`moe_reference`.
    It reads the per-expert counts on the host (the CPU's path; GPU platforms run
    :mod:`dovetail.triton.fused_moe`, which does not).
    """
    check_activation(activation)
    num_tokens, top_k = topk_ids.shape
    flat_ids = local_expert_ids(topk_ids, expert_map).reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    token_of_pair = order // top_k
    num_absent = int((flat_ids < 0).sum())
    counts = torch.bincount(flat_ids[flat_ids >= 0], minlength=w13.shape[0]).tolist()
    order, token_of_pair = order[num_absent:], token_of_pair[num_absent:]  # absent experts sort first (-1)
    rows = x.index_select(0, token_of_pair)
    results = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            block = rows[start:start + count]
            results[start:start + count] = _expert(block, w13, w2, expert, activation, fp8)
            start += count
    weights = topk_weights.reshape(-1).index_select(0, order).unsqueeze(-1)
    out = torch.zeros(num_tokens, x.shape[-1], dtype=torch.float32, device=x.device)
    out.index_add_(0, token_of_pair, results.float() * weights.float())
    return out.to(x.dtype)


def _expert(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, expert: int, activation: str,
            fp8: Fp8ExpertScales | None) -> torch.Tensor:
    if fp8 is None:
        return F.linear(act_and_mul(F.linear(rows, w13[expert]), activation), w2[expert])
    w13f = quant_ops.dequantize_fp8_weight(w13[expert], fp8.w13[expert], fp8.block_size)
    w2f = quant_ops.dequantize_fp8_weight(w2[expert], fp8.w2[expert], fp8.block_size)
    hidden = act_and_mul(F.linear(_fake_quantize(rows, fp8.block_size), w13f), activation).to(rows.dtype)
    return F.linear(_fake_quantize(hidden, fp8.block_size), w2f).to(rows.dtype)
