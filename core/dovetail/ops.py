"""Fused operations the model layers call, in plain torch.

A platform returns a subclass from :meth:`dovetail.platform.Platform.fused_ops`
overriding what it does faster (a C++ or Triton kernel); every override must
match these definitions, which the conformance kit checks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dovetail import moe_ops


class FusedOps:
    """Plain-torch definitions of the fused operations models use."""

    name = "torch"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias``: every unquantized linear layer and the LM head call this."""
        return F.linear(x, weight, bias)

    def linear_gated(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     activation: str) -> torch.Tensor | None:
        """``act(y[..., :N]) * y[..., N:]`` for ``y = linear(x, weight, bias)`` over a merged ``[gate | up]`` weight
        ``[2N, K]`` (``activation``: ``silu`` or ``gelu_tanh``) in one kernel, or None where these ops have none for
        the operands: the layer then calls :meth:`linear` and the activation. An override equals those two steps,
        gate and up rounded to x's dtype before the activation."""
        return None

    def lora_expand(self, shrunk: torch.Tensor, mask: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                    out_sizes: list[int], rank: int) -> torch.Tensor:
        """LoRA's expand step, in place (:mod:`dovetail.lora.layer`): ``out[:, part p] += (shrunk[:, part p], each
        token's row zeroed outside its slot) @ b[:, part p]``. ``shrunk`` is ``[tokens, parts * slots * rank]``,
        ``mask`` the one-hot ``[tokens, slots]``, ``b`` ``[slots * rank, sum(out_sizes)]``."""
        tokens, slots = mask.shape
        parts = shrunk.view(tokens, len(out_sizes), slots, rank) * mask[:, None, :, None]
        offset = 0
        for part, size in enumerate(out_sizes):
            out[:, offset:offset + size].addmm_(parts[:, part].reshape(tokens, slots * rank),
                                                b[:, offset:offset + size])
            offset += size
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x / rms(x) * weight``, computed in float32 and returned in ``x``'s dtype."""
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (xf * weight.float()).to(dtype) if weight.dtype == torch.float32 else xf.to(dtype) * weight

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        """Return ``(rms_norm(x + residual), x + residual)``."""
        summed = x + residual
        return self.rms_norm(summed, weight, eps), summed

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x[..., :d]) * x[..., d:]`` where the last dimension is ``2 * d``."""
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``gelu_tanh(x[..., :d]) * x[..., d:]`` where the last dimension is ``2 * d``."""
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]

    def rotary_embedding(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         cos_sin_cache: torch.Tensor, head_size: int, rotary_dim: int):
        """Rotate the first ``rotary_dim`` features of each head of ``q`` and ``k`` (NeoX style).

        ``q`` is ``[tokens, heads * head_size]`` and ``k`` is
        ``[tokens, kv_heads * head_size]``; ``cos_sin_cache`` is
        ``[max_position, rotary_dim]`` with the cosines in the first half and the
        sines in the second. Returns new ``(q, k)``.
        """
        cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        return (_rotate(q, cos, sin, head_size, rotary_dim), _rotate(k, cos, sin, head_size, rotary_dim))

    def qk_norm_rotary_embedding(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                 q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, eps: float,
                                 cos_sin_cache: torch.Tensor, head_size: int, rotary_dim: int):
        """Per-head RMSNorm of ``q`` and ``k`` (each with its own weight, Qwen 3 / Gemma 3), then the rotary.

        ``q``, ``k`` and the result are as in :meth:`rotary_embedding`; each head's ``head_size``
        features are normalised by :meth:`rms_norm` first.
        """
        q = self.rms_norm(q.unflatten(-1, (-1, head_size)), q_norm_weight, eps).flatten(-2)
        k = self.rms_norm(k.unflatten(-1, (-1, head_size)), k_norm_weight, eps).flatten(-2)
        return self.rotary_embedding(positions, q, k, cos_sin_cache, head_size, rotary_dim)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy sampling's ``logits.argmax(dim=-1)`` (int64) over ``[rows, vocab]`` logits: the first maximal
        index of each row."""
        return logits.argmax(dim=-1)

    def select_experts(self, router_logits: torch.Tensor, top_k: int, renormalize: bool):
        """Mixture-of-experts routing: the ``top_k`` experts of each token by softmax probability (float32), and
        their weights, renormalized to sum to 1 when ``renormalize``. Returns float32 weights and integer ids
        (int32 or int64), both ``[tokens, top_k]``; the definition is :func:`dovetail.moe_ops.select_experts`."""
        return moe_ops.select_experts(router_logits, top_k, renormalize)

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str = "silu", expert_map: torch.Tensor | None = None,
                  fp8: moe_ops.Fp8ExpertScales | None = None) -> torch.Tensor:
        """Mixture-of-experts MLPs of ``x`` ``[tokens, hidden]``: each token through its ``top_k`` experts.

        ``w13`` is ``[experts, 2 * inter, hidden]`` (gate rows, then up rows), ``w2``
        ``[experts, hidden, inter]``; ``topk_weights`` (float32) and ``topk_ids``
        are ``[tokens, top_k]``. ``expert_map`` (global expert id -> row of the weights,
        -1 for experts held by another rank) and FP8 weights with ``fp8`` scales are
        described in :mod:`dovetail.moe_ops`, whose :func:`~dovetail.moe_ops.moe_reference`
        is the definition. A GPU implementation must not read device values on the host
        (decode steps are captured in device graphs).
        """
        return moe_ops.fused_experts(x, w13, w2, topk_weights, topk_ids, activation, expert_map, fp8)

    def routed_moe(self, x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   top_k: int, renormalize: bool, activation: str = "silu", expert_map: torch.Tensor | None = None,
                   fp8: moe_ops.Fp8ExpertScales | None = None) -> torch.Tensor:
        """:meth:`select_experts` of ``router_logits`` ``[tokens, experts]``, then :meth:`fused_moe`: what a
        mixture-of-experts layer calls. A platform may override it to route inside the experts' own kernels;
        the default composes the two, so overriding either of them is enough."""
        weights, ids = self.select_experts(router_logits, top_k, renormalize)
        return self.fused_moe(x, w13, w2, weights, ids, activation, expert_map, fp8)

    def routed_moe_unsummed(self, x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
                            w2: torch.Tensor, top_k: int, renormalize: bool, activation: str = "silu",
                            fp8: moe_ops.Fp8ExpertScales | None = None) -> torch.Tensor | moe_ops.ExpertOutputs:
        """:meth:`routed_moe` for a layer whose output goes straight into :meth:`add_rms_norm_experts`: a platform
        may return the experts' outputs before their weighted sum (:class:`~dovetail.moe_ops.ExpertOutputs`), so
        that the norm's kernel sums them and one launch is saved. The default returns the summed tensor."""
        return self.routed_moe(x, router_logits, w13, w2, top_k, renormalize, activation, None, fp8)

    def add_rms_norm_experts(self, experts: moe_ops.ExpertOutputs, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float):
        """:meth:`add_rms_norm` of the experts' weighted sum (``experts.summed()``) and ``residual``."""
        return self.add_rms_norm(experts.summed(), residual, weight, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int, rotary_dim: int):
    shape = x.shape
    x = x.view(shape[0], -1, head_size)
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = rot.chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if rest.shape[-1]:
        rotated = torch.cat((rotated, rest), dim=-1)
    return rotated.reshape(shape)
