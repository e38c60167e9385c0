"""A checkpoint tensor read lazily: only the part a rank keeps is read from the safetensors file.

Under tensor parallelism each rank keeps a slice of most weights. The loader
hands the model :class:`CheckpointTensor` objects instead of tensors; the layers
narrow them to their rank's part (the same ``narrow`` as ``torch.Tensor``'s) and
:func:`read` then reads just those bytes through ``safe_open(...).get_slice``,
so a rank never holds a whole tensor it keeps only part of.
"""

from __future__ import annotations

import torch

#: safetensors' dtype names.
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class CheckpointTensor:
    """A not-yet-read tensor of an open safetensors file (``safe_open(...).get_slice(name)``), or a box of it.

    ``shape``, ``dtype``, ``dim()`` and ``narrow`` behave as on a tensor;
    :meth:`read` returns the selected part as a ``torch.Tensor``. Valid while its
    file is open, i.e. while the loader's iteration is on its tensor.
    """

    def __init__(self, file_slice, name: str = "", box: tuple[tuple[int, int], ...] | None = None):
        self._slice = file_slice
        self.name = name
        full = tuple(int(s) for s in file_slice.get_shape())
        self._box = box if box is not None else tuple((0, s) for s in full)
        self.shape = torch.Size(length for _, length in self._box)
        self.dtype = _DTYPES.get(file_slice.get_dtype())

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    def narrow(self, dim: int, start: int, length: int) -> "CheckpointTensor":
        """The part ``[start, start + length)`` along ``dim``, still unread."""
        dim = dim % self.dim()
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise IndexError(f"narrow({dim}, {start}, {length}) is outside {self.name or 'a tensor'} "
                             f"of shape {tuple(self.shape)}")
        box = list(self._box)
        offset, _ = box[dim]
        box[dim] = (offset + start, length)
        return CheckpointTensor(self._slice, self.name, tuple(box))

    def read(self) -> torch.Tensor:
        """The selected part, read from the file."""
        if not self._box:
            return self._slice[...]
        return self._slice[tuple(slice(start, start + length) for start, length in self._box)]

    def __repr__(self) -> str:
        return f"CheckpointTensor({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


def read(tensor) -> torch.Tensor:
    """``tensor`` as a ``torch.Tensor``: a :class:`CheckpointTensor` is read, a tensor returned as is."""
    return tensor.read() if isinstance(tensor, CheckpointTensor) else tensor
