"""Python entry points of the C++ kernels: check tensors, then call the library on their data pointers.

Every function checks what the C side assumes (device, dtype, the strides it reads) and raises a
:class:`~dovetail.errors.ConfigError` naming the argument otherwise.
"""

from __future__ import annotations

import ctypes

import torch

from dovetail.errors import ConfigError
from dovetail_cpu import _native
from dovetail_cpu._native import AttentionArgs

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
STATUS = {
    1: "slot_mapping: a slot is beyond the KV cache (num_blocks * block_size)",
    2: "block_table: a block id is negative or beyond the KV cache, or the table is too narrow for seq_lens",
    3: "the batch is inconsistent: query_start_loc must start at 0 and end at the token count, each query "
       "length must be at most its seq_len, num_heads a multiple of num_kv_heads, head_size a multiple of 16",
    4: "positions: a position is negative or beyond cos_sin_cache",
}


def _check_status(status: int) -> None:
    if status:
        raise ConfigError(STATUS.get(status, f"CPU kernel failed with status {status}"))


def dtype_code(t: torch.Tensor, name: str) -> int:
    code = DTYPE_CODES.get(t.dtype)
    if code is None or not t.is_cpu:
        raise ConfigError(f"{name}: the CPU kernels take float32 or bfloat16 CPU tensors "
                          f"(got {t.dtype} on {t.device})")
    return code


def check_rows(t: torch.Tensor, name: str, width: int | None = None) -> None:
    """``t`` is ``[rows, ..., d]`` whose rows may be strided but whose inner dimensions are dense."""
    expected = 1
    shape, strides = t.shape, t.stride()
    for i in range(len(shape) - 1, 0, -1):
        if strides[i] != expected and shape[i] != 1:
            raise ConfigError(f"{name}: all but the first dimension must be contiguous "
                              f"(shape {tuple(shape)}, strides {strides})")
        expected *= shape[i]
    if width is not None and expected != width:
        raise ConfigError(f"{name}: expected rows of {width} elements, got shape {tuple(shape)}")


def _index_tensor(t: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    if t.dtype != dtype or not t.is_cpu or not t.is_contiguous():
        raise ConfigError(f"{name}: expected a contiguous {dtype} CPU tensor (got {t.dtype}, "
                          f"{'contiguous' if t.is_contiguous() else 'strided'}, on {t.device})")
    return t


def batch_args(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
               slot_mapping: torch.Tensor | None, block_size: int, num_threads: int) -> AttentionArgs:
    """The per-step part of the attention arguments (the same for every layer).

    The arguments point into the tensors: keep them alive while the arguments are used.
    """
    args = AttentionArgs()
    args.query_start_loc = _index_tensor(query_start_loc, torch.int32, "query_start_loc").data_ptr()
    args.seq_lens = _index_tensor(seq_lens, torch.int32, "seq_lens").data_ptr()
    args.block_table = _index_tensor(block_table, torch.int32, "block_table").data_ptr()
    args.block_table_stride = block_table.shape[1] if block_table.dim() == 2 else 0
    if slot_mapping is not None:
        args.slot_mapping = _index_tensor(slot_mapping, torch.int64, "slot_mapping").data_ptr()
    if query_start_loc.shape[0] != seq_lens.shape[0] + 1 or block_table.shape[0] < seq_lens.shape[0]:
        raise ConfigError(f"query_start_loc ({query_start_loc.shape[0]}), seq_lens ({seq_lens.shape[0]}) and "
                          f"block_table ({block_table.shape[0]} rows) disagree on the number of sequences")
    args.num_seqs = seq_lens.shape[0]
    args.block_size = block_size
    args.num_threads = max(1, num_threads)
    return args


def _check_cache(kv_cache: torch.Tensor, num_kv_heads: int | None, head_size: int) -> int:
    """The cache's dtype code; it may differ from the model's (a bfloat16 cache for a float32 model)."""
    shape = kv_cache.shape
    code = DTYPE_CODES.get(kv_cache.dtype)
    if (code is None or len(shape) != 5 or shape[0] != 2 or shape[4] != head_size
            or (num_kv_heads is not None and shape[3] != num_kv_heads) or not kv_cache.is_contiguous()):
        raise ConfigError(f"kv_cache: expected a contiguous float32 or bfloat16 cache [2, blocks, block_size, "
                          f"{num_kv_heads or 'kv_heads'}, {head_size}] (got {kv_cache.dtype}, shape {tuple(shape)})")
    return code


def _set_kv(args: AttentionArgs, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype, width: int) -> None:
    for name, t in (("k", k), ("v", v)):
        if t.dtype != dtype:
            raise ConfigError(f"{name}: dtype {t.dtype} differs from q's {dtype}")
        if t.shape[0] != args.num_tokens:
            raise ConfigError(f"{name}: {t.shape[0]} tokens, but the batch has {args.num_tokens}")
        check_rows(t, name, width)
    args.k, args.v, args.k_stride, args.v_stride = k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0)


def paged_attention(args: AttentionArgs, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                    kv_cache: torch.Tensor, scale: float, sliding_window: int | None = None,
                    logit_softcap: float | None = None, out: torch.Tensor | None = None,
                    write_kv: bool = True) -> torch.Tensor:
    """Write ``k``/``v`` at the slots (when ``write_kv``), then attend ``q`` over the paged cache.

    ``args`` comes from :func:`batch_args`; ``kv_cache`` is ``[2, blocks, block_size, kv_heads, head]``.
    """
    tokens, num_heads, head_size = q.shape
    code = dtype_code(q, "q")
    args.cache_dtype = _check_cache(kv_cache, None, head_size)
    shape = kv_cache.shape
    if shape[2] != args.block_size:
        raise ConfigError(f"kv_cache: block size {shape[2]} differs from the batch's {args.block_size}")
    q_strides = q.stride()
    if q_strides[2] != 1 or q_strides[1] != head_size:
        raise ConfigError(f"q: heads and features must be contiguous (shape {tuple(q.shape)}, strides {q_strides})")
    if out is None:
        out = torch.empty((tokens, num_heads, head_size), dtype=q.dtype)
    else:
        check_rows(out, "out", num_heads * head_size)
    args.num_tokens = tokens
    if write_kv and k is not None:
        _set_kv(args, k, v, q.dtype, shape[3] * head_size)
    else:
        args.k = args.v = None
    args.q, args.q_stride = q.data_ptr(), q_strides[0]
    args.out, args.out_stride = out.data_ptr(), out.stride(0)
    base = kv_cache.data_ptr()
    args.key_cache = base
    args.value_cache = base + kv_cache.stride(0) * kv_cache.element_size()
    args.num_blocks = shape[1]
    args.num_heads, args.num_kv_heads, args.head_size = num_heads, shape[3], head_size
    args.sliding_window = sliding_window or 0
    args.scale, args.softcap = scale, logit_softcap or 0.0
    args.dtype = code
    if tokens:
        _check_status(_native.lib().dt_attention(ctypes.byref(args)))
    return out


def write_kv_cache(args: AttentionArgs, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """Store ``k``/``v`` ``[tokens, kv_heads, head]`` at the slots of ``args`` (negative slot: skip)."""
    tokens, num_kv_heads, head_size = k.shape
    code = dtype_code(k, "k")
    args.cache_dtype = _check_cache(kv_cache, num_kv_heads, head_size)
    args.num_tokens = tokens
    _set_kv(args, k, v, k.dtype, num_kv_heads * head_size)
    base = kv_cache.data_ptr()
    args.key_cache, args.value_cache = base, base + kv_cache.stride(0) * kv_cache.element_size()
    args.num_blocks, args.block_size = kv_cache.shape[1], kv_cache.shape[2]
    args.num_kv_heads, args.head_size, args.dtype = num_kv_heads, head_size, code
    _check_status(_native.lib().dt_kv_cache_write(ctypes.byref(args)))


def _check_weight(weight: torch.Tensor, x: torch.Tensor) -> int:
    if weight.dtype not in (torch.float32, x.dtype) or not weight.is_contiguous() or weight.numel() != x.shape[-1]:
        raise ConfigError(f"weight: expected a contiguous float32 or {x.dtype} vector of {x.shape[-1]} "
                          f"(got {weight.dtype}, shape {tuple(weight.shape)})")
    return DTYPE_CODES[weight.dtype]


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x`` as ``[rows, n]`` without copying; its rows may be strided, its last dimension must be dense."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if rows.stride(1) != 1 and rows.shape[1] != 1:
        raise ConfigError(f"{name}: the last dimension must be contiguous (shape {tuple(x.shape)}, "
                          f"strides {x.stride()})")
    return rows


def _like(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x) if x.is_contiguous() else torch.empty(x.shape, dtype=x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, num_threads: int) -> torch.Tensor:
    """``FusedOps.rms_norm``: float32 statistics, the weight applied as the torch definition applies it."""
    n = x.shape[-1]
    wcode = _check_weight(weight, x)
    rows = _rows(x, "x")
    out = _like(x)
    _native.lib().dt_rms_norm(rows.data_ptr(), rows.stride(0), weight.data_ptr(), wcode,
                              out.data_ptr(), n, rows.shape[0], n, eps, dtype_code(x, "x"), num_threads)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 num_threads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``FusedOps.add_rms_norm``: ``(rms_norm(x + residual), x + residual)`` in one pass."""
    n = x.shape[-1]
    wcode = _check_weight(weight, x)
    if residual.dtype != x.dtype or residual.shape != x.shape:
        raise ConfigError(f"residual: expected {x.dtype} of shape {tuple(x.shape)} "
                          f"(got {residual.dtype}, {tuple(residual.shape)})")
    xr, rr = _rows(x, "x"), _rows(residual, "residual")
    out, summed = _like(x), _like(x)
    _native.lib().dt_add_rms_norm(xr.data_ptr(), xr.stride(0), rr.data_ptr(), rr.stride(0), weight.data_ptr(),
                                  wcode, out.data_ptr(), summed.data_ptr(), xr.shape[0], n, eps,
                                  dtype_code(x, "x"), num_threads)
    return out, summed


def silu_and_mul(x: torch.Tensor, num_threads: int) -> torch.Tensor:
    """``FusedOps.silu_and_mul``: ``silu(x[..., :d]) * x[..., d:]``."""
    d = x.shape[-1] // 2
    rows = _rows(x, "x")
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype)
    _native.lib().dt_silu_and_mul(rows.data_ptr(), rows.stride(0), out.data_ptr(), rows.shape[0], d,
                                  dtype_code(x, "x"), num_threads)
    return out


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                     head_size: int, rotary_dim: int, num_threads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX rotary on ``q`` ``[tokens, heads * head]`` and ``k`` ``[tokens, kv_heads * head]``; new tensors."""
    tokens, q_width = q.shape
    k_width = k.shape[1]
    if q.stride(1) != 1 or k.stride(1) != 1 or k.shape[0] != tokens or positions.shape != (tokens,):
        raise ConfigError(f"q, k, positions: expected [tokens, heads * head_size] rows with a dense last "
                          f"dimension and one position per token (q {tuple(q.shape)}, k {tuple(k.shape)}, "
                          f"positions {tuple(positions.shape)})")
    if k.dtype != q.dtype:
        raise ConfigError(f"k: dtype {k.dtype} differs from q's {q.dtype}")
    if q_width % head_size or k_width % head_size:
        raise ConfigError(f"head_size: {head_size} does not divide q's {q_width} or k's {k_width} features")
    if cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous() or cos_sin_cache.shape[1] != rotary_dim:
        raise ConfigError(f"cos_sin_cache: expected a contiguous float32 [positions, {rotary_dim}] tensor "
                          f"(got {cos_sin_cache.dtype}, shape {tuple(cos_sin_cache.shape)})")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_size:
        raise ConfigError(f"rotary_dim: must be even and in (0, head_size={head_size}] (got {rotary_dim})")
    positions = _index_tensor(positions, torch.int64, "positions")
    q_out = torch.empty(tokens, q_width, dtype=q.dtype)
    k_out = torch.empty(tokens, k_width, dtype=q.dtype)
    status = _native.lib().dt_rotary_neox(
        positions.data_ptr(), cos_sin_cache.shape[0], q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
        q_out.data_ptr(), k_out.data_ptr(), cos_sin_cache.data_ptr(), tokens, q_width // head_size,
        k_width // head_size, head_size, rotary_dim, dtype_code(q, "q"), num_threads)
    _check_status(status)
    return q_out, k_out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_threads: int) -> torch.Tensor:
    """``F.linear`` for a few rows (decode): the weight streamed once, split over every thread.

    ``x`` ``[..., k]`` in float32 or bfloat16; ``weight`` ``[n, k]`` contiguous in float32 or ``x``'s dtype;
    ``bias`` ``[n]`` in ``x``'s dtype or None.
    """
    k = x.shape[-1]
    rows = _rows(x, "x")
    code = dtype_code(x, "x")
    if weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous() or weight.dtype not in (torch.float32,
                                                                                                       x.dtype):
        raise ConfigError(f"weight: expected a contiguous float32 or {x.dtype} [n, {k}] matrix "
                          f"(got {weight.dtype}, shape {tuple(weight.shape)})")
    n = weight.shape[0]
    if bias is not None and (bias.dtype != x.dtype or bias.shape != (n,) or not bias.is_contiguous()):
        raise ConfigError(f"bias: expected a contiguous {x.dtype} vector of {n} (got {bias.dtype}, "
                          f"shape {tuple(bias.shape)})")
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    _native.lib().dt_linear(rows.data_ptr(), rows.stride(0), weight.data_ptr(), DTYPE_CODES[weight.dtype],
                            None if bias is None else bias.data_ptr(), out.data_ptr(), rows.shape[0], n, k, code,
                            num_threads)
    return out
