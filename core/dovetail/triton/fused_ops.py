"""TritonFusedOps: the fused operations of :mod:`dovetail.ops` as Triton kernels.

A GPU platform returns ``TritonFusedOps()`` from ``Platform.fused_ops()``. Each
operation equals the torch definition it overrides (within the dtype's
rounding); inputs a kernel does not cover (empty tensors, unusual dtype mixes)
go to that definition. Unquantized linears of up to ``gemv_max_rows`` tokens run
:func:`dovetail.triton.gemv.gemv` instead of the vendor's GEMM where the platform turns that on
(it measured faster there).
"""

from __future__ import annotations

import torch

from dovetail.ops import FusedOps
from dovetail.triton import activation, argmax, fused_moe, gemv, lora, moe_routing, norm, rotary

#: Most tokens for which a 16-bit unquantized linear runs the Triton GEMV where a platform turns it on
#: (the cuda platform on Hopper). At one token the GEMV beat cuBLAS on nearly every layer linear of
#: llama-3.1-8b and qwen3-0.6b, and on their LM heads by 10-12% with register sums over 4 weight rows; at 2
#: and 4 tokens cuBLAS was faster on most (benchmarks/RESULTS.md, Kernels).
GEMV_MAX_ROWS = 1
#: The most tokens for which a Hopper GPU runs a 16-bit gate/up projection and its activation as one gated GEMV
#: (:func:`dovetail.triton.gemv.gemv_gated`): where it beat cuBLAS's product and the activation's kernel together
#: (benchmarks/RESULTS.md, Kernels).
GATED_GEMV_MAX_ROWS = 16


def gemv_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 max_rows: int = GEMV_MAX_ROWS) -> bool:
    """Whether the Triton GEMV takes ``F.linear(x, weight, bias)``: at most ``max_rows`` 16-bit tokens on a
    GPU (not the CPU, where triton only interprets) and a weight of x's dtype."""
    return (x.device.type != "cpu" and weight.dim() == 2
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and x.shape[-1] == weight.shape[1] and 0 < x.numel() <= max_rows * x.shape[-1]
            and (bias is None or bias.dtype == x.dtype))


def _routes_in_kernels(x, router_logits, w13, w2, top_k: int, fp8) -> bool:
    """Whether :func:`dovetail.triton.fused_moe.routed_moe` takes these operands (one row of logits a token)."""
    return (moe_routing.supports(router_logits, top_k) and fused_moe.supports(x, w13, w2, router_logits, fp8)
            and router_logits.shape[0] == x.shape[0])


class TritonFusedOps(FusedOps):
    """RMSNorm (with the residual add), NeoX rotary (with per-head q/k norms), SiLU-and-mul,
    GELU-tanh-and-mul, greedy sampling's argmax and the mixture of experts (routing and the fused
    experts) in Triton; batch-1 linears on the Triton GEMV
    where the platform asks for it.

    ``gemv_max_rows``: the most tokens for which 16-bit linears run the Triton GEMV (0, the default:
    never; the platform that creates these ops sets it where the GEMV beat its GEMM library).
    ``gated_gemv_max_rows``: likewise for a merged gate/up projection and its activation in one GEMV
    (:meth:`linear_gated`), where that beat the GEMM library's product and the activation's kernel.
    """

    name = "triton"

    def __init__(self, gemv_max_rows: int = 0, gated_gemv_max_rows: int = 0):
        super().__init__()
        self.gemv_max_rows = gemv_max_rows
        self.gated_gemv_max_rows = gated_gemv_max_rows

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.gemv_max_rows and gemv_applies(x, weight, bias, self.gemv_max_rows):
            return gemv.gemv(x, weight, bias)
        return super().linear(x, weight, bias)

    def linear_gated(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     activation: str) -> torch.Tensor | None:
        if (self.gated_gemv_max_rows and activation in gemv.GATED_ACTIVATIONS and weight.shape[0] % 2 == 0
                and gemv_applies(x, weight, bias, self.gated_gemv_max_rows)):
            return gemv.gemv_gated(x, weight, bias, activation)
        return None

    def lora_expand(self, shrunk: torch.Tensor, mask: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                    out_sizes: list[int], rank: int) -> torch.Tensor:
        if not (lora.supports(mask.shape[0], out_sizes) and out.is_contiguous() and b.is_contiguous() and mask.is_contiguous()
                and shrunk.stride(1) == 1):
            return super().lora_expand(shrunk, mask, b, out, out_sizes, rank)
        return lora.lora_expand(shrunk, mask, b, out, out_sizes, rank)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not norm.supports(x, weight):
            return super().rms_norm(x, weight, eps)
        return norm.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        if not norm.supports(x, weight) or residual.shape != x.shape or residual.dtype != x.dtype:
            return super().add_rms_norm(x, residual, weight, eps)
        return norm.rms_norm(x, weight, eps, residual=residual)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.device.type == "cpu" or not argmax.supports(logits):
            return super().argmax(logits)
        return argmax.argmax(logits)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return super().silu_and_mul(x)
        return activation.act_and_mul(x, gelu_tanh=False)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return super().gelu_tanh_and_mul(x)
        return activation.act_and_mul(x, gelu_tanh=True)

    def rotary_embedding(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         cos_sin_cache: torch.Tensor, head_size: int, rotary_dim: int):
        if not rotary.supports(positions, q, k, cos_sin_cache, head_size, rotary_dim):
            return super().rotary_embedding(positions, q, k, cos_sin_cache, head_size, rotary_dim)
        return rotary.rotary_embedding(positions, q, k, cos_sin_cache, head_size, rotary_dim)

    def qk_norm_rotary_embedding(self, positions, q, k, q_norm_weight, k_norm_weight, eps, cos_sin_cache,
                                 head_size, rotary_dim):
        if not (rotary.supports(positions, q, k, cos_sin_cache, head_size, rotary_dim)
                and rotary.supports_qk_norm(q_norm_weight, k_norm_weight, q, head_size, rotary_dim)):
            return super().qk_norm_rotary_embedding(positions, q, k, q_norm_weight, k_norm_weight, eps,
                                                    cos_sin_cache, head_size, rotary_dim)
        return rotary.rotary_embedding(positions, q, k, cos_sin_cache, head_size, rotary_dim,
                                       q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, eps=eps)

    def select_experts(self, router_logits: torch.Tensor, top_k: int, renormalize: bool):
        if not moe_routing.supports(router_logits, top_k):
            return super().select_experts(router_logits, top_k, renormalize)
        return moe_routing.topk_softmax(router_logits, top_k, renormalize)

    def fused_moe(self, x, w13, w2, topk_weights, topk_ids, activation="silu", expert_map=None, fp8=None):
        if not fused_moe.supports(x, w13, w2, topk_ids, fp8):
            return super().fused_moe(x, w13, w2, topk_weights, topk_ids, activation, expert_map, fp8)
        return fused_moe.fused_moe(x, w13, w2, topk_weights, topk_ids, activation, expert_map, fp8)

    def routed_moe(self, x, router_logits, w13, w2, top_k, renormalize, activation="silu", expert_map=None, fp8=None):
        if not _routes_in_kernels(x, router_logits, w13, w2, top_k, fp8):
            return super().routed_moe(x, router_logits, w13, w2, top_k, renormalize, activation, expert_map, fp8)
        return fused_moe.routed_moe(x, router_logits, w13, w2, top_k, renormalize, activation, expert_map, fp8)

    def routed_moe_unsummed(self, x, router_logits, w13, w2, top_k, renormalize, activation="silu", fp8=None):
        if not _routes_in_kernels(x, router_logits, w13, w2, top_k, fp8):
            return super().routed_moe_unsummed(x, router_logits, w13, w2, top_k, renormalize, activation, fp8)
        return fused_moe.routed_moe(x, router_logits, w13, w2, top_k, renormalize, activation, None, fp8,
                                    unsummed=True)

    def add_rms_norm_experts(self, experts, residual, weight, eps):
        pairs = experts.pairs
        if not norm.supports(pairs, weight) or residual.dtype != pairs.dtype or residual.shape != (
                experts.weights.shape[0], pairs.shape[-1]):
            return super().add_rms_norm_experts(experts, residual, weight, eps)
        return norm.rms_norm(pairs, weight, eps, residual=residual, pair_weights=experts.weights)
