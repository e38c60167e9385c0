"""Llama (2, 3, 3.1, 3.2): the decoder most other architectures here extend.

Subclasses change one piece at a time: the decoder layer's attention options
(:meth:`LlamaDecoderLayer.sliding_window`, q/k norms, scale, rope), its MLP
(:meth:`LlamaDecoderLayer.make_mlp`), the model's embedding scale and norm
offset, and the LM head's final soft-capping.
"""

from __future__ import annotations

from typing import ClassVar, Iterable

import torch
from torch import nn

from dovetail.distributed import tp_size
from dovetail.layers.activation import gated_activation
from dovetail.layers.attention import Attention
from dovetail.layers.embedding import LMHead, VocabEmbedding
from dovetail.distributed.partition import divide
from dovetail.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from dovetail.layers.norm import RMSNorm
from dovetail.layers.rotary import RotaryEmbedding, rope_parameters
from dovetail.layers.weights import WeightMapper
from dovetail.model_interface import AttentionShape, DovetailModel, ModelContext, run_to_end


def head_dim(config) -> int:
    """The explicit ``head_dim`` when the config has one, else ``hidden_size / num_attention_heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def window_from_layer_types(config, layer_index: int) -> int | None:
    """``sliding_window`` for the layers transformers 5's ``layer_types`` marks ``"sliding_attention"``."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types and layer_types[layer_index] == "sliding_attention":
        return getattr(config, "sliding_window", None) or None
    return None


def window_on_every_layer(config, layer_index: int) -> int | None:
    """``sliding_window`` on every layer (Mistral, Mixtral, Phi-3); None disables it."""
    return getattr(config, "sliding_window", None) or None


class LlamaAttention(nn.Module):
    """Merged QKV projection, optional q/k RMSNorm, rotary embedding, paged attention, output projection.

    Under tensor parallelism each rank runs its share of the heads (QKV column-parallel,
    ``o_proj`` row-parallel with an all-reduce).

    ``scale`` defaults to ``head_dim ** -0.5``; ``rope`` to the config's rope
    parameters; ``qk_norm_offset`` (None: no q/k norm) is 0 for Qwen 3 and 1
    for Gemma 3's ``(1 + weight)`` norms; ``qkv_bias`` and ``o_bias`` default to the
    config's ``attention_bias``; ``use_rope=False`` makes a NoPE layer (SmolLM3, EXAONE 4.0's global layers).
    """

    def __init__(self, config, layer_index: int, ctx: ModelContext, prefix: str, *,
                 sliding_window: int | None = None, qkv_bias: bool | None = None, scale: float | None = None,
                 rope: dict | None = None, logit_softcap: float | None = None,
                 qk_norm_offset: float | None = None, o_bias: bool | None = None, use_rope: bool = True):
        super().__init__()
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = getattr(config, "num_key_value_heads", None) or self.total_num_heads
        self.head_dim = head_dim(config)
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, self.total_num_heads,
                                          self.total_num_kv_heads, bias if qkv_bias is None else qkv_bias, ctx,
                                          f"{prefix}.qkv_proj")
        # This rank's heads (all of them with one rank).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(self.total_num_heads * self.head_dim, config.hidden_size,
                                        bias if o_bias is None else o_bias, ctx, f"{prefix}.o_proj")
        if qk_norm_offset is None:
            self.q_norm = self.k_norm = None
        else:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ctx, weight_offset=qk_norm_offset)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ctx, weight_offset=qk_norm_offset)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings,
                                          rope if rope is not None else rope_parameters(config), ctx,
                                          config.max_position_embeddings)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5 if scale is None else scale,
                              self.num_kv_heads, ctx, layer_index, sliding_window=sliding_window,
                              logit_softcap=logit_softcap)
        self.use_rope = use_rope

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if not self.use_rope:
            if self.q_norm is not None:
                q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
                k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
            return self.o_proj(self.attn(q, k, v))
        # The per-head norms (when present) and the rotary are the backend's to apply, in its kernels if it can.
        return self.o_proj(self.attn.forward_rotary(positions, q, k, v, self.rotary_emb, self.q_norm, self.k_norm))

    def leave_output_unreduced(self) -> None:
        """Return this rank's partial sum; the norm after it all-reduces it (see :class:`LlamaModel`)."""
        self.o_proj.reduce_results = False


class LlamaMLP(nn.Module):
    """Merged gate/up projection, gated activation, down projection (column- then row-parallel).

    ``size_field`` names the config field of ``intermediate_size`` in errors; ``reduce_results=False`` leaves
    the down projection's partial sum to the caller (a MoE block reduces it with the experts').
    """

    def __init__(self, config, ctx: ModelContext, prefix: str, intermediate_size: int | None = None,
                 hidden_act: str | None = None, size_field: str = "intermediate_size", reduce_results: bool = True):
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        divide(inter, size_field)
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [inter, inter], bias, ctx,
                                                 f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias, ctx, f"{prefix}.down_proj",
                                           reduce_results=reduce_results)
        self.act_fn = gated_activation(hidden_act or config.hidden_act, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_gated(x, self.act_fn))

    def leave_output_unreduced(self) -> None:
        """Return this rank's partial sum; the norm after it all-reduces it (see :class:`LlamaModel`)."""
        self.down_proj.reduce_results = False


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; the residual add is fused into the norms."""

    def __init__(self, config, layer_index: int, ctx: ModelContext, prefix: str):
        super().__init__()
        self.self_attn = self.make_attention(config, layer_index, ctx, f"{prefix}.self_attn")
        self.mlp = self.make_mlp(config, layer_index, ctx, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)

    @staticmethod
    def sliding_window(config, layer_index: int) -> int | None:
        """This layer's attention window (None: global attention); Llama has none."""
        return None

    @staticmethod
    def attn_logit_softcap(config) -> float | None:
        """The attention-score soft-cap (None: none); Llama has none."""
        return None

    def make_attention(self, config, layer_index, ctx, prefix):
        return LlamaAttention(config, layer_index, ctx, prefix, sliding_window=self.sliding_window(config, layer_index),
                              logit_softcap=self.attn_logit_softcap(config))

    def make_mlp(self, config, layer_index, ctx, prefix):
        return LlamaMLP(config, ctx, prefix)

    def can_leave_outputs_unreduced(self) -> bool:
        return all(hasattr(block, "leave_output_unreduced") for block in (self.self_attn, self.mlp))

    def leave_outputs_unreduced(self, input_is_unreduced: bool) -> None:
        """Attention and MLP return partial sums, which the norms after them all-reduce; this layer's input is
        the previous layer's MLP output, unreduced too unless the layer is the first."""
        self.self_attn.leave_output_unreduced()
        self.mlp.leave_output_unreduced()
        self.post_attention_layernorm.all_reduce_input = True
        self.input_layernorm.all_reduce_input = input_is_unreduced

    def forward(self, positions, hidden_states, residual):
        return run_to_end(self.forward_steps(positions, hidden_states, residual))

    def forward_steps(self, positions, hidden_states, residual):
        """:meth:`forward`, pausing after each norm: the all-reduce of the block before it is issued by then."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        yield
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        yield
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm.

    Under tensor parallelism the sums of the attention's and the MLP's row-parallel outputs move into the norms
    that follow them (each layer's two and the final one), where the platform can fuse the all-reduce with the
    residual add and the norm. Where any layer's blocks cannot leave their outputs unreduced (another layer
    class), every layer keeps reducing its own.
    """

    layer_cls: ClassVar[type[nn.Module]] = LlamaDecoderLayer
    #: Added to every norm weight: 1.0 for Gemma's ``(1 + weight)`` norms.
    norm_offset: ClassVar[float] = 0.0

    def __init__(self, config, ctx: ModelContext, prefix: str = "model"):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, ctx,
                                           scale=self.embedding_scale(config))
        self.layers = nn.ModuleList(self.layer_cls(config, i, ctx, f"{prefix}.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.norm = self.make_norm(config, ctx)
        if tp_size() > 1 and all(hasattr(layer, "leave_outputs_unreduced") and layer.can_leave_outputs_unreduced()
                                 for layer in self.layers):
            for index, layer in enumerate(self.layers):
                layer.leave_outputs_unreduced(input_is_unreduced=index > 0)
            self.norm.all_reduce_input = True
        for layer in self.layers:  # every layer's MLP output goes into the next layer's first norm, or the last
            leave = getattr(getattr(layer, "mlp", None), "leave_expert_sum_to_norm", None)
            if leave is not None:
                leave()

    @classmethod
    def embedding_scale(cls, config) -> float | None:
        """The factor the embeddings are multiplied by (None: none)."""
        return None

    @classmethod
    def make_norm(cls, config, ctx: ModelContext) -> nn.Module:
        """The final norm."""
        return RMSNorm(config.hidden_size, config.rms_norm_eps, ctx, weight_offset=cls.norm_offset)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return run_to_end(self.forward_steps(input_ids, positions))

    def forward_steps(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """:meth:`forward`, pausing after each collective (see :class:`~dovetail.model_interface.DovetailModel`);
        a layer without ``forward_steps`` pauses once, after it."""
        hidden_states, residual = self.embed_tokens(input_ids), None
        yield
        for layer in self.layers:
            steps = getattr(layer, "forward_steps", None)
            if steps is None:
                hidden_states, residual = layer(positions, hidden_states, residual)
                yield
            else:
                hidden_states, residual = yield from steps(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(DovetailModel):
    """Llama causal LM: GQA, llama3/linear/dynamic/yarn rope scaling, tied or separate LM head."""

    model_cls: ClassVar[type[nn.Module]] = LlamaModel
    #: Extra checkpoint-name regexes to skip when loading.
    ignore_weights: ClassVar[tuple[str, ...]] = ()
    #: ``(pattern, replacement)`` applied to checkpoint names before loading.
    rename_weights: ClassVar[tuple[tuple[str, str], ...]] = ()
    #: For the supported-models table: checkpoints of this architecture, and what it exercises.
    example_models: ClassVar[tuple[str, ...]] = (
        "meta-llama/Llama-2-7b-hf", "meta-llama/Meta-Llama-3-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct",
        "meta-llama/Llama-3.2-1B-Instruct")
    features: ClassVar[tuple[str, ...]] = ("GQA", "rope scaling (llama3, linear, dynamic, yarn)",
                                           "tied embeddings (3.2)")

    def __init__(self, hf_config, prefix: str = "", *, ctx: ModelContext):
        super().__init__(hf_config, prefix, ctx=ctx)
        self.model = self.model_cls(hf_config, ctx, f"{prefix}model")
        tied = self.model.embed_tokens if getattr(hf_config, "tie_word_embeddings", False) else None
        self.lm_head = LMHead(hf_config.vocab_size, hf_config.hidden_size, ctx, tied_to=tied,
                              final_logit_softcap=self.final_logit_softcap(hf_config))

    @classmethod
    def final_logit_softcap(cls, config) -> float | None:
        """The soft-cap of the final logits (None: none); Llama has none."""
        return None

    @classmethod
    def attention_shape(cls, hf_config) -> AttentionShape:
        layer = cls.model_cls.layer_cls
        num_heads = hf_config.num_attention_heads
        windows = [layer.sliding_window(hf_config, i) for i in range(hf_config.num_hidden_layers)]
        return AttentionShape(
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_size=head_dim(hf_config),
            uses_sliding_window=any(windows),
            uses_logit_softcap=bool(layer.attn_logit_softcap(hf_config)),
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def forward_steps(self, input_ids: torch.Tensor, positions: torch.Tensor):
        return (yield from self.model.forward_steps(input_ids, positions))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def sharded_lm_head(self) -> LMHead | None:
        return self.lm_head if self.lm_head.shard.split else None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        ignore = list(self.ignore_weights)
        if self.lm_head.tied:
            ignore.append(r"^lm_head\.weight$")
        return WeightMapper(self, ignore=ignore, rename=self.rename_weights).load(weights)
