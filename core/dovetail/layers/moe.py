"""Mixture of experts: top-k routing, and every expert's gated MLP in one layer.

:class:`FusedMoE` stacks the experts' weights into two tensors, ``w13_weight``
``[experts, 2 * intermediate, hidden]`` (each expert's gate rows, then its up
rows) and ``w2_weight`` ``[experts, hidden, intermediate]``, loaded from the
checkpoint's per-expert tensors. It computes all experts in one call to the
platform's :meth:`dovetail.ops.FusedOps.fused_moe`, whose plain-torch default is
:func:`fused_experts`; :func:`moe_reference` is the definition both must match.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dovetail.checkpoint_tensor import read
from dovetail.errors import ModelLoadError, SelectionError
from dovetail.model_interface import ModelContext

#: Gated activations the experts support, by HF ``hidden_act`` name.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` experts of each token and their weights, as HF routes (softmax in float32 first).

    Returns float32 weights ``[tokens, top_k]`` (renormalized to sum to 1 when
    ``renormalize``) and int64 expert ids ``[tokens, top_k]``.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _act_and_mul(h: torch.Tensor, activation: str) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_pytorch_tanh":
        return F.gelu(gate, approximate="tanh") * up
    raise ValueError(f"activation {activation!r} is not supported by the MoE layer "
                     f"(supported: {', '.join(ACTIVATIONS)})")


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """The definition: ``out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])``.

    Every expert runs on every token, densely (slow; for tests), where
    ``expert_e(x) = w2[e] @ act_and_mul(w13[e] @ x)``. Returns ``x``'s shape and dtype.
    """
    hidden = _act_and_mul(torch.einsum("th,eih->tei", x, w13), activation)  # [tokens, experts, inter]
    per_expert = torch.einsum("tei,ehi->teh", hidden, w2)  # [tokens, experts, hidden]
    chosen = per_expert.gather(1, topk_ids.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # [tokens, top_k, hidden]
    return (chosen.float() * topk_weights.float().unsqueeze(-1)).sum(dim=1).to(x.dtype)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """All experts in one pass: the (token, expert) pairs sorted by expert, one matmul pair per expert hit.

    Only the selected experts run, each on the contiguous block of its tokens;
    the weighted results are summed back per token. Matches :func:`moe_reference`.
    """
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    token_of_pair = order // top_k
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    rows = x.index_select(0, token_of_pair)
    results = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            block = rows[start:start + count]
            results[start:start + count] = F.linear(_act_and_mul(F.linear(block, w13[expert]), activation), w2[expert])
            start += count
    weights = topk_weights.reshape(-1).index_select(0, order).unsqueeze(-1)
    out = torch.zeros(num_tokens, x.shape[-1], dtype=torch.float32, device=x.device)
    out.index_add_(0, token_of_pair, results.float() * weights.float())
    return out.to(x.dtype)


class FusedMoE(nn.Module):
    """The experts of one mixture-of-experts block; ``forward(x, router_logits)`` routes and runs them.

    - ``top_k``: experts per token; ``renormalize``: rescale the chosen
      experts' probabilities to sum to 1 (HF's ``norm_topk_prob``; Mixtral always does).
    - Checkpoint tensors load per expert through :meth:`load_expert` (gate,
      up and down projections) or whole through :meth:`load_stacked`.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 ctx: ModelContext, prefix: str = "", renormalize: bool = True, activation: str = "silu"):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ModelLoadError(f"{prefix}: num_experts_per_tok must be between 1 and the number of experts "
                                 f"({num_experts}), got {top_k}")
        if activation not in ACTIVATIONS:
            raise ModelLoadError(f"{prefix}: hidden_act {activation!r} is not supported by the MoE layer "
                                 f"(supported: {', '.join(ACTIVATIONS)})")
        if ctx.quant.name != "none" and ctx.quant.quantizes(prefix):
            raise SelectionError(f"quantization {ctx.quant.name!r} cannot run this model: it does not quantize "
                                 f"mixture-of-experts layers ({prefix})")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activation = activation
        self.prefix = prefix
        self.ops = ctx.ops
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=ctx.dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=ctx.dtype),
                                      requires_grad=False)
        self._loaded: dict[str, set] = {"w13_weight": set(), "w2_weight": set()}

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        return self.ops.fused_moe(x, self.w13_weight, self.w2_weight, weights, ids, self.activation)

    # -- loading ---------------------------------------------------------------------------

    def load_expert(self, param_name: str, tensor: torch.Tensor, expert: int, shard: int | None, name: str) -> bool:
        """Copy one expert's checkpoint tensor: ``w13_weight`` shard 0 (gate) or 1 (up), or ``w2_weight``.

        Returns True once every expert's part of ``param_name`` is loaded.
        """
        if not 0 <= expert < self.num_experts:
            raise ModelLoadError(f"tensor {name!r} names expert {expert}, but {self.prefix} has "
                                 f"{self.num_experts} experts (num_experts in config.json)")
        target = getattr(self, param_name).data[expert]
        if shard is not None:
            target = target.narrow(0, shard * self.intermediate_size, self.intermediate_size)
        self._copy(target, tensor, name, f"{param_name}[{expert}]" + (f" shard {shard}" if shard is not None else ""))
        self._loaded[param_name].add((expert, shard))
        parts = 2 if param_name == "w13_weight" else 1
        return len(self._loaded[param_name]) == self.num_experts * parts

    def load_stacked(self, param_name: str, tensor: torch.Tensor, name: str) -> bool:
        """Copy a checkpoint tensor holding every expert at once (transformers 5's own layout)."""
        self._copy(getattr(self, param_name).data, tensor, name, param_name)
        return True

    def _copy(self, target: torch.Tensor, tensor: torch.Tensor, name: str, what: str) -> None:
        if tuple(target.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, but {self.prefix}.{what} "
                                 f"expects {tuple(target.shape)}")
        target.copy_(read(tensor))

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"inter={self.intermediate_size}, renormalize={self.renormalize}, act={self.activation}")
