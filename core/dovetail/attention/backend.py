"""The AttentionBackend contract: paged attention over a mixed prefill/decode batch.

A backend declares what it supports as class attributes, explains why a
configuration does not fit (:meth:`AttentionBackend.validate`), says how its KV
cache is shaped, turns the engine's per-step :class:`~dovetail.attention.batch.AttentionBatch`
into its own metadata once per step (:class:`AttentionMetadataBuilder`), and
provides an :class:`AttentionImpl` per attention layer.

Semantics every backend must implement (``REFERENCE`` is the definition):

- Tokens of all sequences are flattened; sequence ``i`` owns query rows
  ``query_start_loc[i]:query_start_loc[i+1]``, which are the *last* tokens of
  its context of ``seq_lens[i]`` tokens (the earlier ones are already cached).
- Before attending, the new keys and values are written into the paged cache at
  ``slot_mapping`` (slot = block number * block_size + offset; a negative slot
  means "do not write", used for padding; such a token's own output is then
  unspecified).
- A query at absolute position ``p`` sees keys at positions ``j <= p``; with a
  sliding window ``w``, only ``p - w < j <= p``.
- Scores are ``scale * q . k``; with logit soft-capping ``c``, they become
  ``c * tanh(score / c)`` before the softmax.
- Grouped-query attention: query head ``h`` reads KV head
  ``h // (num_heads // num_kv_heads)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar

if TYPE_CHECKING:
    import torch

    from dovetail.attention.batch import AttentionBatch


@dataclass(frozen=True)
class AttentionRequirements:
    """What a model, on a configuration, asks of its attention backend."""

    platform: str
    device_type: str
    dtype: "torch.dtype"
    kv_cache_dtype: str
    block_size: int
    head_size: int
    num_heads: int
    num_kv_heads: int
    uses_sliding_window: bool = False
    uses_logit_softcap: bool = False


@dataclass(frozen=True)
class AttentionLayerSpec:
    """One attention layer's shape and options."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None = None
    logit_softcap: float | None = None


class AttentionMetadataBuilder:
    """Turns the engine's step description into the backend's metadata, once per step.

    The default passes the :class:`AttentionBatch` through unchanged. Backends
    that plan (FlashInfer) or reorder override :meth:`build`; the result is
    handed to every layer's :meth:`AttentionImpl.forward` in that step.

    ``independent_builds``: two builds' results can be in use at once (each build makes its own tensors), so
    the runner may split a step into micro-batches (:mod:`dovetail.engine.micro_batches`); a builder that
    plans into buffers it keeps sets it False.
    """

    independent_builds: bool = True

    def __init__(self, backend: type["AttentionBackend"], layer_specs: list[AttentionLayerSpec],
                 block_size: int, device: "torch.device", dtype: "torch.dtype"):
        self.backend = backend
        self.layer_specs = layer_specs
        self.block_size = block_size
        self.device = device
        self.dtype = dtype

    def build(self, batch: "AttentionBatch") -> Any:
        return batch

    def build_for_graph(self, batch: "AttentionBatch", graph_size: int) -> Any:
        """Metadata for a decode-only batch of ``graph_size`` sequences that a device graph replays (or, for a
        backend that ``supports_uniform_query_graphs``, one of ``max_query_len`` tokens a sequence).

        Called when the graph of that size is captured, then before each of its
        replays. The batch's device tensors are the graph's static buffers (the
        same addresses every call, this step's values); padding sequences have
        length 1 (``max_query_len``) and write to a spare block; ``max_seq_len`` is an upper bound
        (``max_model_len``), and the ``*_cpu`` tensors hold this step's values.
        Whatever the captured forward reads from the device must stay at the
        same addresses for a given ``graph_size``: a planning backend re-plans
        into buffers it keeps per size. Only backends declaring
        ``supports_graph_capture`` are asked; the default is :meth:`build`.
        """
        return self.build(batch)


@dataclass(frozen=True)
class RotaryInputs:
    """The rotary embedding a layer's ``q`` and ``k`` still need, handed to :meth:`AttentionImpl.forward_rotary`.

    ``cos_sin_cache`` is float32 ``[max_position, rotary_dim]`` (cosines, then sines: NeoX style) and
    ``positions`` holds each token's position. With ``q_norm_weight`` and ``k_norm_weight`` each head is
    RMS-normalised first (Qwen 3, Gemma 3), with ``eps``. ``apply(positions, q, k)`` does all of it with
    the platform's ops on flattened ``[tokens, heads * head_size]`` rows and returns the new ``(q, k)``.
    """

    positions: "torch.Tensor"
    cos_sin_cache: "torch.Tensor"
    rotary_dim: int
    apply: Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor"], tuple["torch.Tensor", "torch.Tensor"]]
    q_norm_weight: "torch.Tensor | None" = None
    k_norm_weight: "torch.Tensor | None" = None
    eps: float = 1e-6


class AttentionImpl(ABC):
    """The attention computation of one layer.

    ``k_scale`` and ``v_scale`` are the layer's per-tensor scales for an 8-bit KV cache, as vLLM's: such a
    cache holds ``key / k_scale`` and ``value / v_scale``. They are 1.0 unless the checkpoint carries calibrated
    ``k_scale`` / ``v_scale`` tensors; backends without 8-bit caches ignore them.
    """

    def __init__(self, spec: AttentionLayerSpec):
        self.spec = spec
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward_rotary(self, q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", kv_cache: "torch.Tensor",
                       metadata: Any, rotary: RotaryInputs) -> "torch.Tensor":
        """:meth:`forward` of ``q`` and ``k`` before their rotary embedding (shapes as there).

        The default applies ``rotary`` and calls :meth:`forward`; a backend may do the rotation inside its
        own kernels instead, and must then give the same result.
        """
        q_rot, k_rot = rotary.apply(rotary.positions, q.flatten(1), k.flatten(1))
        return self.forward(q_rot.view(q.shape), k_rot.view(k.shape), v, kv_cache, metadata)

    @abstractmethod
    def forward(self, q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor",
                kv_cache: "torch.Tensor", metadata: Any) -> "torch.Tensor":
        """Write ``k``/``v`` into ``kv_cache`` at the slots, then attend.

        ``q`` is ``[tokens, num_heads, head_size]``, ``k`` and ``v`` are
        ``[tokens, num_kv_heads, head_size]``; returns ``[tokens, num_heads, head_size]``
        in ``q``'s dtype. ``kv_cache`` has the backend's :meth:`~AttentionBackend.kv_cache_shape`.
        """


class AttentionBackend(ABC):
    """A paged-attention implementation and its declared capabilities.

    Set the class attributes to declare what the backend supports; ``None`` for
    a tuple means "any". ``supported_dtypes`` and ``supported_kv_cache_dtypes``
    use names: ``"float32"``, ``"float16"``, ``"bfloat16"``; KV-cache dtypes
    add ``"auto"`` (the model's dtype) and e.g. ``"fp8_e4m3"``.
    """

    name: ClassVar[str]
    #: Where this implementation was verified, or what was never run (shown by ``dovetail plugins``).
    verification: ClassVar[str] = ""
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = None
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "float16", "bfloat16")
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    supported_block_sizes: ClassVar[tuple[int, ...] | None] = None
    supports_sliding_window: ClassVar[bool] = True
    supports_logit_softcap: ClassVar[bool] = True
    supports_gqa: ClassVar[bool] = True
    supported_device_types: ClassVar[tuple[str, ...] | None] = None
    #: Whether the backend's forward can be captured in a CUDA graph for decode.
    supports_graph_capture: ClassVar[bool] = False
    #: Whether it can also be captured for batches whose sequences all compute the same number of tokens
    #: (speculative decoding's steps: the last token and the drafts), built by ``build_for_graph`` with
    #: ``max_query_len`` tokens a sequence and no decodes.
    supports_uniform_query_graphs: ClassVar[bool] = False

    @classmethod
    def available(cls) -> str | None:
        """The reason the backend cannot run in this environment (a missing package), or None."""
        return None

    @classmethod
    def validate(cls, req: AttentionRequirements) -> list[str]:
        """Reasons this backend does not fit ``req``; empty when it fits.

        The default checks the declared capabilities; override to add checks and
        call ``super().validate(req)``.
        """
        reasons = []
        missing = cls.available()
        if missing:
            reasons.append(missing)
        if cls.supported_device_types is not None and req.device_type not in cls.supported_device_types:
            reasons.append(f"device type {req.device_type!r} not supported by {cls.name} "
                           f"(supported: {', '.join(cls.supported_device_types)})")
        if cls.supported_head_sizes is not None and req.head_size not in cls.supported_head_sizes:
            reasons.append(f"head size {req.head_size} not supported by {cls.name} "
                           f"(supported: {', '.join(map(str, cls.supported_head_sizes))})")
        dtype_name = str(req.dtype).removeprefix("torch.")
        if dtype_name not in cls.supported_dtypes:
            reasons.append(f"dtype {dtype_name} not supported by {cls.name} "
                           f"(supported: {', '.join(cls.supported_dtypes)})")
        if req.kv_cache_dtype not in cls.supported_kv_cache_dtypes:
            reasons.append(f"kv_cache_dtype {req.kv_cache_dtype!r} not supported by {cls.name} "
                           f"(supported: {', '.join(cls.supported_kv_cache_dtypes)})")
        if cls.supported_block_sizes is not None and req.block_size not in cls.supported_block_sizes:
            reasons.append(f"block size {req.block_size} not supported by {cls.name} "
                           f"(supported: {', '.join(map(str, cls.supported_block_sizes))})")
        if req.uses_sliding_window and not cls.supports_sliding_window:
            reasons.append(f"sliding-window attention not supported by {cls.name}")
        if req.uses_logit_softcap and not cls.supports_logit_softcap:
            reasons.append(f"logit soft-capping not supported by {cls.name}")
        if req.num_heads != req.num_kv_heads and not cls.supports_gqa:
            reasons.append(f"grouped-query attention ({req.num_heads} query heads, "
                           f"{req.num_kv_heads} KV heads) not supported by {cls.name}")
        if req.num_kv_heads <= 0 or req.num_heads % req.num_kv_heads:
            reasons.append(f"num_heads ({req.num_heads}) must be a multiple of num_kv_heads "
                           f"({req.num_kv_heads}) for {cls.name}")
        return reasons

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_size: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache; the default is ``[2, blocks, block_size, kv_heads, head_size]``."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def cache_from_reference(cls, ref_cache: "torch.Tensor") -> "torch.Tensor":
        """This backend's cache holding the same contents as a REFERENCE-layout cache.

        Used by the conformance kit; override together with :meth:`cache_to_reference`
        when :meth:`kv_cache_shape` differs from the default layout.
        """
        return ref_cache.clone()

    @classmethod
    def cache_to_reference(cls, cache: "torch.Tensor") -> "torch.Tensor":
        """The inverse of :meth:`cache_from_reference`."""
        return cache

    @classmethod
    def metadata_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        """The class that builds this backend's per-step metadata."""
        return AttentionMetadataBuilder

    @classmethod
    @abstractmethod
    def impl_cls(cls) -> type[AttentionImpl]:
        """The per-layer implementation class."""

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        """The declared capabilities, for documentation tables and ``dovetail plugins``."""
        return {
            "head_sizes": "any" if cls.supported_head_sizes is None else list(cls.supported_head_sizes),
            "dtypes": list(cls.supported_dtypes),
            "kv_cache_dtypes": list(cls.supported_kv_cache_dtypes),
            "block_sizes": "any" if cls.supported_block_sizes is None else list(cls.supported_block_sizes),
            "sliding_window": cls.supports_sliding_window,
            "logit_softcap": cls.supports_logit_softcap,
            "gqa": cls.supports_gqa,
            "graph_capture": cls.supports_graph_capture,
            "uniform_query_graphs": cls.supports_uniform_query_graphs,
        }
