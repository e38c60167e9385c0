"""The attention layer: calls the selected backend over the paged KV cache."""

from __future__ import annotations

import torch
from torch import nn

from dovetail.attention.backend import AttentionLayerSpec, RotaryInputs
from dovetail.forward_context import get_forward_context
from dovetail.model_interface import ModelContext


class Attention(nn.Module):
    """Paged attention of one layer; the runner binds ``kv_cache`` after allocating it.

    ``layer_index`` orders the caches; ``sliding_window`` and ``logit_softcap``
    are per layer (Gemma alternates windowed and global layers).
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, ctx: ModelContext,
                 layer_index: int, sliding_window: int | None = None, logit_softcap: float | None = None):
        super().__init__()
        self.spec = AttentionLayerSpec(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                                       scale=scale, sliding_window=sliding_window or None,
                                       logit_softcap=logit_softcap or None)
        self.layer_index = layer_index
        self.impl = ctx.attention_backend.impl_cls()(self.spec)
        self.kv_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q``, ``k``, ``v`` flattened ``[tokens, heads * head_size]``; returns the same shape as ``q``."""
        return self._per_head(self.impl.forward, q, k, v)

    def _per_head(self, impl_method, q, k, v, *extra) -> torch.Tensor:
        """``impl_method`` on per-head views of flattened ``q``, ``k``, ``v`` and this layer's cache; its output
        flattened again."""
        tokens = q.shape[0]
        spec = self.spec
        out = impl_method(
            q.view(tokens, spec.num_heads, spec.head_size),
            k.view(tokens, spec.num_kv_heads, spec.head_size),
            v.view(tokens, spec.num_kv_heads, spec.head_size),
            self.kv_cache, get_forward_context().attn_metadata, *extra,
        )
        return out.reshape(tokens, spec.num_heads * spec.head_size)

    def forward_rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       rotary_emb, q_norm=None, k_norm=None) -> torch.Tensor:
        """:meth:`forward` of ``q`` and ``k`` before ``rotary_emb`` (a
        :class:`~dovetail.layers.rotary.RotaryEmbedding`), and before the per-head RMSNorms ``q_norm`` and
        ``k_norm`` when given. The backend applies them, in its own kernels where it can."""
        if q_norm is None:
            def apply(pos, q2, k2):
                return rotary_emb(pos, q2, k2)
            rotary = RotaryInputs(positions, rotary_emb.cos_sin_cache, rotary_emb.rotary_dim, apply)
        else:
            def apply(pos, q2, k2):
                return rotary_emb.forward_with_qk_norm(pos, q2, k2, q_norm, k_norm)
            rotary = RotaryInputs(positions, rotary_emb.cos_sin_cache, rotary_emb.rotary_dim, apply,
                                  q_norm.weight, k_norm.weight, q_norm.eps)
        return self._per_head(self.impl.forward_rotary, q, k, v, rotary)
