"""Mixture-of-experts routing in one kernel: softmax over the experts, the top k, and their renormalization.

Equals :func:`dovetail.moe_ops.select_experts` (HF's Qwen-MoE and Mixtral routers):
probabilities in float32, the ``top_k`` largest (the lowest expert id first among
equal ones), divided by their sum when ``renormalize``. One program takes a tile of
tokens with every expert's logit in registers, so a decode step routes in one
launch instead of torch's softmax, top-k, sum and division. :func:`route_tile` is
that routing for one tile, which the MoE alignment's kernels also call
(:func:`dovetail.triton.moe_align.route_and_align`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dovetail.triton import next_power_of_2
from dovetail.triton.pdl import launch_kwargs, pdl_prologue, use_pdl

#: Most experts the kernel routes among (every logit of a token sits in registers).
MAX_EXPERTS = 1024


@triton.jit
def route_tile(logits_ptr, weights_ptr, ids_ptr, rows, num_tokens, num_experts, stride_lt, TOP_K: tl.constexpr,
               K_P2: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """Route the ``BLOCK_T`` tokens ``rows``: store their weights and expert ids (``[tokens, TOP_K]``) and return
    the ids (``[rows, K_P2]``) with the mask of those that are real (rows past the end and slots past ``TOP_K``
    are not)."""
    experts = tl.arange(0, BLOCK_E)
    row_ok = rows < num_tokens
    col_ok = experts < num_experts
    logits = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_lt + experts[None, :],
                     mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    logits = tl.where(col_ok[None, :], logits, float("-inf"))
    exps = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = exps / tl.sum(exps, axis=1)[:, None]
    probs = tl.where(col_ok[None, :], probs, -1.0)
    slots = tl.arange(0, K_P2)
    chosen_w = tl.zeros((BLOCK_T, K_P2), dtype=tl.float32)
    chosen_id = tl.zeros((BLOCK_T, K_P2), dtype=tl.int32)
    total = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)
        # the lowest expert id holding the maximum
        best_id = tl.min(tl.where(probs == best[:, None], experts[None, :], BLOCK_E), axis=1)
        chosen_w = tl.where(slots[None, :] == j, best[:, None], chosen_w)
        chosen_id = tl.where(slots[None, :] == j, best_id[:, None], chosen_id)
        total += best
        probs = tl.where(experts[None, :] == best_id[:, None], -1.0, probs)
    if RENORMALIZE:
        chosen_w = chosen_w / total[:, None]
    out = rows[:, None] * TOP_K + slots[None, :]
    keep = row_ok[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + out, chosen_w, mask=keep)
    tl.store(ids_ptr + out, chosen_id, mask=keep)
    return chosen_id, keep


@triton.jit(do_not_specialize=["num_tokens"])
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_lt,
                         TOP_K: tl.constexpr, K_P2: tl.constexpr, RENORMALIZE: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    route_tile(logits_ptr, weights_ptr, ids_ptr, rows, num_tokens, num_experts, stride_lt, TOP_K, K_P2, RENORMALIZE,
               BLOCK_T, BLOCK_E)


def supports(router_logits: torch.Tensor, top_k: int) -> bool:
    """Whether :func:`topk_softmax` takes these logits (2-D, unit stride over experts, few enough experts)."""
    return (router_logits.dim() == 2 and router_logits.shape[0] > 0 and router_logits.stride(-1) == 1
            and 0 < top_k <= router_logits.shape[1] <= MAX_EXPERTS
            and router_logits.dtype in (torch.float32, torch.float16, torch.bfloat16))


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 weights and int32 expert ids ``[tokens, top_k]`` of each token's ``top_k`` experts."""
    tokens, experts = router_logits.shape
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=router_logits.device)
    block_e = next_power_of_2(experts)
    block_t = max(1, min(next_power_of_2(tokens), 2048 // block_e))
    _topk_softmax_kernel[(triton.cdiv(tokens, block_t),)](
        router_logits, weights, ids, tokens, experts, router_logits.stride(0),
        TOP_K=top_k, K_P2=next_power_of_2(top_k), RENORMALIZE=renormalize, BLOCK_T=block_t, BLOCK_E=block_e,
        num_warps=4 if block_t * block_e >= 2048 else 1, **launch_kwargs(use_pdl(router_logits.device)))
    return weights, ids
