"""Linear layers whose weights come from the model's quantization method, whole or split among ranks.

:class:`Linear` covers plain and merged projections: a merged layer (QKV,
gate/up) has several ``output_sizes`` and loads each from its own checkpoint
tensor by shard index, or all at once from a fused checkpoint tensor.

Under tensor parallelism (``dovetail.distributed.tp_size() > 1`` when the layer
is built) the subclasses keep a slice of the weight on each rank, as vLLM's do:

- :class:`ColumnParallelLinear` splits the outputs (each merged part on its own);
  every rank computes its slice of ``y`` and nothing is communicated;
- :class:`QKVParallelLinear` splits the heads, replicating KV heads when there
  are fewer of them than ranks;
- :class:`RowParallelLinear` splits the inputs; the partial products are summed
  by an all-reduce (the bias is added once, on rank 0).

A parameter says which of its dimensions index output and input features
(``output_dim`` and ``input_dim``, see :mod:`dovetail.quantization.base`); the
layer narrows each checkpoint tensor to its rank's part along them before it is
read. With one rank the parts are whole: the same weights, kernels and no
collective.
"""

from __future__ import annotations

import torch
from torch import nn

from dovetail.checkpoint_tensor import read
from dovetail.distributed import all_reduce, tp_rank, tp_size
from dovetail.distributed.partition import WHOLE, Part, divide, kv_head_part, rank_part
from dovetail.errors import ModelLoadError
from dovetail.model_interface import ModelContext
from dovetail.quantization.kernels import QuantKernels
from dovetail.quantization.unquantized import UnquantizedMethod

_DEFAULT_KERNELS = QuantKernels()


class Linear(nn.Module):
    """``y = x @ W.T + b`` through the quantization hook; ``output_sizes`` are its shards.

    Built this way it is replicated: every rank holds the whole weight. The
    parallel subclasses pass ``output_parts`` (one :class:`~dovetail.distributed.partition.Part`
    per output shard) or ``input_part``; ``input_size`` and ``output_sizes`` are
    then this rank's, ``total_input_size`` and ``total_output_sizes`` the checkpoint's.
    """

    def __init__(self, input_size: int, output_sizes: int | list[int], bias: bool, ctx: ModelContext,
                 prefix: str = "", *, output_parts: list[Part] | None = None, input_part: Part = WHOLE):
        super().__init__()
        totals = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.prefix = prefix
        self.output_parts = list(output_parts) if output_parts is not None else [WHOLE] * len(totals)
        self.input_part = input_part
        self.total_input_size = input_size
        self.total_output_sizes = totals
        self.input_size = self._local(input_size, input_part, "input size")
        self.output_sizes = [self._local(size, part, "output size") for size, part in zip(totals, self.output_parts)]
        self.output_size = sum(self.output_sizes)
        #: Whether this rank holds only part of the weight (loading then narrows checkpoint tensors).
        self.is_sharded = not input_part.whole or any(not p.whole for p in self.output_parts)
        #: The platform's quantization kernels (``Platform.quant_kernels()``), which quantized methods call.
        self.quant_kernels = ctx.quant_kernels or _DEFAULT_KERNELS
        #: The platform's fused ops; the unquantized method calls their ``linear``.
        self.ops = ctx.ops
        self.method = ctx.quant if ctx.quant.quantizes(prefix) else UnquantizedMethod()
        self.method.create_weights(self, self.input_size, self.output_sizes, ctx.dtype)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size, dtype=ctx.dtype), requires_grad=False)
            self.bias.output_dim = 0
        else:
            self.register_parameter("bias", None)
        #: The LoRA slots (:class:`dovetail.lora.layer.LinearLoRA`) of an engine serving adapters, else None.
        self.lora = None

    def _local(self, size: int, part: Part, what: str) -> int:
        if part.whole:
            return size
        return divide(size, f"layer {self.prefix}: {what}", part.count)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x, self.bias)
        return out if self.lora is None else self.lora.add_to(x, out)

    def forward_gated(self, x: torch.Tensor, activation: nn.Module) -> torch.Tensor:
        """``activation(self(x))`` for a gated activation over this merged ``[gate | up]`` layer: one kernel
        where the quantization method has one for the activation's ``name``, else the two steps."""
        name = getattr(activation, "name", None) if self.lora is None else None
        fused = self.method.apply_gated(self, x, self.bias, name) if name else None
        return activation(self.forward(x)) if fused is None else fused

    # -- loading ---------------------------------------------------------------------------

    def load_shard(self, param: nn.Parameter, tensor, shard: int | None, name: str) -> None:
        """Copy checkpoint ``tensor`` into ``param``: whole (``shard=None``) or as output shard ``shard``.

        ``tensor`` is a ``torch.Tensor`` or a :class:`~dovetail.checkpoint_tensor.CheckpointTensor`; only
        this rank's part of it is read.
        """
        output_dim = getattr(param, "output_dim", None)
        if (shard is None and len(self.output_sizes) > 1 and any(not p.whole for p in self.output_parts)
                and output_dim is not None and not _broadcast(tensor, output_dim)):
            for index, part in enumerate(self._fused_parts(tensor, output_dim, name)):
                self.load_shard(param, part, index, name)
            return
        tensor = self._rank_slice(param, tensor, shard, name)
        loader = getattr(param, "weight_loader", None)
        if loader is not None:
            loader(param, read(tensor), shard)
            return
        target = param.data
        if shard is not None and output_dim is not None:
            scale_num, scale_den = target.shape[output_dim], self.output_size
            start = sum(self.output_sizes[:shard]) * scale_num // scale_den
            length = self.output_sizes[shard] * scale_num // scale_den
            target = target.narrow(output_dim, start, length)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}"
                                 + (" (this rank's part)" if self.is_sharded else "")
                                 + f", but parameter {self.prefix}.{_param_name(self, param)} expects "
                                 f"{tuple(target.shape)}" + (f" for shard {shard}" if shard is not None else ""))
        target.copy_(read(tensor))

    def _rank_slice(self, param: nn.Parameter, tensor, shard: int | None, name: str):
        """This rank's part of a checkpoint tensor (unread): narrowed along the parameter's split dimensions.
        A dimension of size 1 is a broadcast value (a per-tensor scale, a single group) and stays whole."""
        if not self.is_sharded:
            return tensor
        splits = ((getattr(param, "output_dim", None), self.output_parts[0 if shard is None else shard]),
                  (getattr(param, "input_dim", None), self.input_part))
        for dim, part in splits:
            if dim is None or part.whole or _broadcast(tensor, dim):
                continue
            start, length = part.of(tensor.shape[dim], f"tensor {name!r} (dimension {dim})")
            tensor = tensor.narrow(dim, start, length)
        return tensor

    def _fused_parts(self, tensor, dim: int, name: str):
        """A fused checkpoint tensor (Phi-3's ``qkv_proj``) cut into its merged parts, by the checkpoint's sizes."""
        total, length = sum(self.total_output_sizes), tensor.shape[dim]
        start = 0
        for size in self.total_output_sizes:
            if (size * length) % total:
                raise ModelLoadError(f"tensor {name!r}: dimension {dim} ({length}) does not split into the parts "
                                     f"{self.total_output_sizes} of layer {self.prefix}")
            part = size * length // total
            yield tensor.narrow(dim, start, part)
            start += part

    def extra_repr(self) -> str:
        text = f"in={self.input_size}, out={self.output_sizes}, method={self.method.name}"
        if self.is_sharded:
            text += f", of in={self.total_input_size}, out={self.total_output_sizes}"
        return text


class ColumnParallelLinear(Linear):
    """Outputs split among the ranks, each merged part on its own (a merged ``[gate | up]`` holds
    ``[gate_r | up_r]`` on rank ``r``); no communication: each rank continues with its slice of ``y``."""

    def __init__(self, input_size: int, output_sizes: int | list[int], bias: bool, ctx: ModelContext,
                 prefix: str = ""):
        count = 1 if isinstance(output_sizes, int) else len(output_sizes)
        super().__init__(input_size, output_sizes, bias, ctx, prefix, output_parts=[rank_part()] * count)


class QKVParallelLinear(Linear):
    """The merged query/key/value projection with the heads divided among the ranks.

    ``num_heads`` and ``num_kv_heads`` are this rank's; with fewer KV heads than
    ranks each rank holds one, replicated on ``tp_size / total_num_kv_heads`` ranks.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int, bias: bool,
                 ctx: ModelContext, prefix: str = ""):
        num_heads = divide(total_num_heads, "num_attention_heads")
        num_kv_heads, kv_part = kv_head_part(total_num_kv_heads)
        sizes = [total_num_heads * head_size, total_num_kv_heads * head_size, total_num_kv_heads * head_size]
        super().__init__(hidden_size, sizes, bias, ctx, prefix, output_parts=[rank_part(), kv_part, kv_part])
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size


class RowParallelLinear(Linear):
    """Inputs split among the ranks: each multiplies its slice of ``x`` (the output of a column-parallel
    layer or of this rank's heads) and an all-reduce sums the partial products; the bias is added on rank 0.

    ``reduce_results=False`` leaves the partial sum for the caller to reduce.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool, ctx: ModelContext, prefix: str = "",
                 reduce_results: bool = True):
        super().__init__(input_size, output_size, bias, ctx, prefix, input_part=rank_part())
        self.reduce_results = reduce_results and tp_size() > 1
        self.adds_bias = tp_rank() == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x, self.bias if self.adds_bias else None)
        if self.lora is not None:  # this rank's part of the update: the all-reduce sums it with the others'
            out = self.lora.add_to(x, out)
        return all_reduce(out) if self.reduce_results else out


def _broadcast(tensor, dim: int) -> bool:
    return dim >= tensor.dim() or tensor.shape[dim] == 1


def _param_name(module: nn.Module, param: nn.Parameter) -> str:
    for name, p in module.named_parameters(recurse=False):
        if p is param:
            return name
    return "?"
