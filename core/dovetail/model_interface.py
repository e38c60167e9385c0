"""The model contract: what an architecture implementation provides to the engine.

A model is a ``torch.nn.Module`` subclass of :class:`DovetailModel`, registered
under its HF architecture name (``register_models``). The engine builds it
from the HF config, a weight-name prefix and a :class:`ModelContext`, loads its
weights from ``(name, tensor)`` pairs, and runs it on flattened tokens.

Models are built from the core layers in :mod:`dovetail.layers` so that
quantization methods (linear layers), attention backends (the attention layer)
and platforms (fused ops) reach them without monkey-patching.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generator, Iterable

import torch
from torch import nn

if TYPE_CHECKING:
    from dovetail.attention.backend import AttentionBackend
    from dovetail.ops import FusedOps
    from dovetail.quantization.base import QuantMethod
    from dovetail.quantization.kernels import QuantKernels


@dataclass
class ModelContext:
    """What layers need at construction: dtype, device, and the selected implementations."""

    dtype: torch.dtype
    device: torch.device
    quant: "QuantMethod"
    attention_backend: type["AttentionBackend"]
    ops: "FusedOps"
    quant_kernels: "QuantKernels | None" = None


def run_to_end(steps: Generator[None, None, torch.Tensor]) -> torch.Tensor:
    """What a ``forward_steps`` generator returns, run without pausing."""
    while True:
        try:
            next(steps)
        except StopIteration as finished:
            return finished.value


@dataclass(frozen=True)
class AttentionShape:
    """A model's attention geometry and features, used to validate backends."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    uses_sliding_window: bool = False
    uses_logit_softcap: bool = False


class DovetailModel(nn.Module):
    """A causal language model Dovetail can run.

    Subclasses implement ``__init__(hf_config, prefix, ctx)``, :meth:`forward`,
    :meth:`compute_logits` and :meth:`load_weights`, and override
    :meth:`attention_shape` when the HF config's standard fields do not
    describe their attention.

    Optionally ``forward_steps(input_ids, positions)``: :meth:`forward` as a generator that pauses (yields)
    right after each collective it issues and returns the hidden states (:func:`run_to_end` runs one). With
    it, a large step under tensor parallelism may run as two micro-batches whose collectives overlap each
    other's compute (:mod:`dovetail.engine.micro_batches`); without it (None) steps stay whole.
    """

    forward_steps = None

    def __init__(self, hf_config, prefix: str = "", *, ctx: ModelContext):
        super().__init__()
        self.config = hf_config
        self.prefix = prefix
        self.ctx = ctx

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[tokens, hidden]`` for flattened ``input_ids`` at ``positions``.

        The attention layers read this step's metadata from
        :func:`dovetail.forward_context.get_forward_context`.
        """

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits ``[rows, vocab]`` for the selected rows of hidden states."""

    def sharded_lm_head(self):
        """Under tensor parallelism, the vocabulary-parallel :class:`~dovetail.layers.embedding.LMHead` that
        :meth:`compute_logits` applies and nothing else, so that greedy steps sample from each rank's columns
        without gathering the logits; None (the default): the runner calls :meth:`compute_logits`."""
        return None

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors by HF name; return the names of the parameters filled.

        Under tensor parallelism (``dovetail.distributed.tp_size() > 1``) the tensors are
        :class:`~dovetail.checkpoint_tensor.CheckpointTensor` objects, read only in the
        part a rank keeps: :class:`~dovetail.layers.weights.WeightMapper` and the core
        layers handle both kinds; other code reads one with ``dovetail.checkpoint_tensor.read``.

        Raise :class:`dovetail.errors.ModelLoadError` naming any unexpected or
        mis-shaped tensor.
        """

    @classmethod
    def attention_shape(cls, hf_config) -> AttentionShape:
        """The attention geometry, read from the usual HF config fields."""
        num_heads = hf_config.num_attention_heads
        head_size = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        window = getattr(hf_config, "sliding_window", None)
        if getattr(hf_config, "use_sliding_window", True) is False:
            window = None
        return AttentionShape(
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_size=head_size,
            uses_sliding_window=bool(window),
            uses_logit_softcap=bool(getattr(hf_config, "attn_logit_softcapping", None)),
        )
