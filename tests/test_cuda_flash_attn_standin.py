"""FLASH_ATTN's argument marshalling on the CPU, against stand-in ``flash_attn`` modules.

No FlashAttention build is installed where CI runs (FlashAttention-4 ran on an
H100: ``tests/test_cuda_backends.py``, ``benchmarks/gpu.sh``), so the
stand-ins check the arguments as the packages document them (shapes, int32
metadata, FA2's blocks of a multiple of 256) and compute the documented
semantics: keys gathered through the block table, ``causal`` aligned to the
end of the keys, ``window_size=(left, 0)`` keeping keys ``>= i + sk - sq - left``,
``softcap``. The backend must then agree with REFERENCE through the conformance kit.
"""

from __future__ import annotations

import importlib
import os
import types

import pytest
import torch

if not torch.cuda.is_available():  # FlashAttention-4 on Hopper decodes through the Triton kernel: its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dovetail import testing  # noqa: E402
from dovetail_cuda import flash_attn_backend  # noqa: E402
from dovetail_cuda.flash_attn_backend import FlashAttnBackend  # noqa: E402


def _attend_paged(q, k_cache, v_cache, cu_q, seqlens_k, table, scale, causal, window, softcap):
    assert q.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape
    assert q.dtype in (torch.float16, torch.bfloat16) and k_cache.dtype == q.dtype
    assert cu_q.dtype == torch.int32 and table.dtype == torch.int32 and seqlens_k.dtype == torch.int32
    assert causal and window[1] in (0, -1)
    heads, kv_heads, page = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    out = torch.empty_like(q)
    for i in range(cu_q.numel() - 1):
        start, end, sk = int(cu_q[i]), int(cu_q[i + 1]), int(seqlens_k[i])
        pages = table[i, :-(-sk // page)].long()
        keys = k_cache[pages].reshape(-1, kv_heads, q.shape[2])[:sk].float().repeat_interleave(heads // kv_heads, 1)
        values = v_cache[pages].reshape(-1, kv_heads, q.shape[2])[:sk].float().repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        sq = end - start
        row = torch.arange(sq).view(-1, 1) + sk - sq
        col = torch.arange(sk).view(1, -1)
        hidden = col > row
        if window[0] >= 0:
            hidden |= col < row - window[0]
        scores = scores.masked_fill(hidden, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
    return out


def _fa2_module():
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        assert block_table is not None and k.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256"
        assert cu_seqlens_k.dtype == torch.int32
        seqlens_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).int()
        assert int(seqlens_k.max()) <= max_seqlen_k and int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) <= max_seqlen_q
        return _attend_paged(q, k, v, cu_seqlens_q, seqlens_k, block_table, softmax_scale, causal, window_size,
                             softcap)

    return types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)


def _fa3_module():
    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                                cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                                q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                                window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                                scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                                return_softmax_lse=False):
        assert k is None and v is None and page_table is not None and max_seqlen_q is not None
        return _attend_paged(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, page_table, softmax_scale, causal,
                             window_size, softcap)

    return types.SimpleNamespace(flash_attn_with_kvcache=flash_attn_with_kvcache)


def _fa4_module():
    def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None,
                               gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False,
                               window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1,
                               pack_gqa=None, deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None,
                               block_sparse_tensors=None, aux_tensors=None, aux_scalars=None, return_lse=False,
                               scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False,
                               gather_bwd_recompute_p=False, gather_bwd_token_chunk=None):
        assert page_table is not None and cu_seqlens_k is None, "page_table is not supported with cu_seqlens_k"
        assert seqused_k is not None and seqused_k.shape == (cu_seqlens_q.numel() - 1,)
        assert page_table.shape[0] == seqused_k.shape[0] and page_table.stride(-1) == 1
        assert max_seqlen_q is not None and not isinstance(max_seqlen_q, torch.Tensor)
        left, right = window_size
        window = (-1 if left is None else left, -1 if right is None else right)
        out = _attend_paged(q, k, v, cu_seqlens_q, seqused_k, page_table, softmax_scale, causal, window, softcap)
        return out, None

    return types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)


MODULES = {"fa2": ("flash_attn", _fa2_module), "fa3": ("flash_attn_interface", _fa3_module),
           "fa4": ("flash_attn.cute", _fa4_module)}


@pytest.fixture(params=["fa2", "fa3", "fa4", "fa4-hopper"])
def version(request, monkeypatch):
    """A stand-in build; ``fa4-hopper`` is FlashAttention-4 on sm_90, where the decodes go through Triton."""
    chosen = request.param.removesuffix("-hopper")
    for name in MODULES:
        monkeypatch.setattr(flash_attn_backend, f"{name}_installed", lambda name=name: name == chosen)
    monkeypatch.setattr(flash_attn_backend, "variant", lambda capability_major=None: chosen)
    monkeypatch.setattr(flash_attn_backend, "_capability_major", lambda: 9 if request.param == "fa4-hopper" else 0)
    monkeypatch.setattr(FlashAttnBackend, "supported_device_types", None)
    name, build = MODULES[chosen]
    module = build()
    real_import = importlib.import_module
    others = {module_name for module_name, _ in MODULES.values()} - {name}

    def import_module(requested, *args):
        if requested in others:
            pytest.fail(f"imported {requested}")
        return module if requested == name else real_import(requested, *args)

    monkeypatch.setattr(flash_attn_backend.importlib, "import_module", import_module)
    return request.param


CASES = [c for c in testing.attention_cases(head_sizes=(64,), block_sizes=(16, 256))]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_flash_attn_marshalling_matches_reference(version, case):
    assert FlashAttnBackend.impl_cls() is (flash_attn_backend.FlashAttn4PrefillImpl if version == "fa4-hopper"
                                           else flash_attn_backend.FlashAttnImpl)
    # Triton's rotary rounds once where REFERENCE rounds each product: in bfloat16 that can be one unit (1/32
    # at outputs of 4-8) past the kit's 3e-2, as TRITON alone is on the CPU; float16 keeps the check tight.
    dtype = torch.float16 if version == "fa4-hopper" else torch.bfloat16
    if version == "fa2" and case.block_size % 256:
        with pytest.raises(testing.NotApplicable, match="block size 16 not supported by FLASH_ATTN"):
            testing.check_attention_case(FlashAttnBackend, case, dtype=dtype, platform="cuda")
        return
    testing.check_attention_case(FlashAttnBackend, case, dtype=dtype, platform="cuda")


def test_graph_metadata_stays_in_one_buffer(version):
    """What a captured decode reads must keep its address: FA2's ``cu_seqlens_k``, or Triton's decode order."""
    from dovetail.attention.backend import AttentionLayerSpec
    from dovetail.attention.batch import AttentionBatch

    builder = FlashAttnBackend.metadata_builder_cls()(FlashAttnBackend, [AttentionLayerSpec(4, 2, 64, 0.125)], 256,
                                                      torch.device("cpu"), torch.bfloat16)
    first = builder.build_for_graph(AttentionBatch.from_lists([1, 1], [5, 300], [[0], [1, 2]], 256), 2)
    second = builder.build_for_graph(AttentionBatch.from_lists([1, 1], [7, 9], [[0], [1]], 256), 2)
    if version == "fa4-hopper":
        assert first.decode_order.data_ptr() == second.decode_order.data_ptr()
        assert second.decode_order.tolist() == [1, 0]  # longest context first
        return
    assert first.cu_seqlens_k.data_ptr() == second.cu_seqlens_k.data_ptr()
    assert second.cu_seqlens_k.tolist() == [0, 7, 16]


@pytest.mark.parametrize("version", ["fa4-hopper"], indirect=True)
def test_fa4_on_hopper_takes_only_the_prefills(version):
    """Decodes go to the Triton kernel; FlashAttention-4 sees the other sequences alone, their queries from 0."""
    from dovetail.attention.backend import AttentionLayerSpec
    from dovetail.attention.batch import AttentionBatch

    impl = FlashAttnBackend.impl_cls()(AttentionLayerSpec(4, 2, 64, 0.125))
    calls = []
    standin = impl.attend

    def counted(q, *args, **kwargs):
        calls.append((q.shape[0], kwargs["cu_seqlens_q"].tolist(), kwargs["seqused_k"].tolist()))
        return standin(q, *args, **kwargs)

    impl.attend = counted
    builder = FlashAttnBackend.metadata_builder_cls()(FlashAttnBackend, [impl.spec], 16, torch.device("cpu"),
                                                      torch.float16)
    cache = torch.randn(2, 8, 16, 2, 64, dtype=torch.float16)
    for query_lens, seq_lens, tables in [([1, 1], [9, 20], [[0], [1, 2]]), ([1, 6, 3], [9, 6, 20], [[0], [3], [4, 5]])]:
        batch = AttentionBatch.from_lists(query_lens, seq_lens, tables, 16)
        q, k, v = (torch.randn(batch.num_tokens, h, 64, dtype=torch.float16) for h in (4, 2, 2))
        impl.forward(q, k, v, cache, builder.build(batch))
    assert calls == [(9, [0, 6, 9], [6, 20])], calls


def _fake_packages(root, *files):
    for name in files:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")


CUTLASS_CU13 = ("nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/"
                "_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so")


@pytest.mark.parametrize("files, fa2, fa4", [
    (["flash_attn/__init__.py"], True, False),
    (["flash_attn/cute/interface.py", CUTLASS_CU13], False, True),
    (["flash_attn/cute/interface.py"], False, False),
    (["flash_attn/cute/interface.py", "nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py"], False, False),
    (["flash_attn/__init__.py", "flash_attn/cute/interface.py", CUTLASS_CU13], True, True),
], ids=["fa2", "fa4 alone: a namespace package", "fa4 without cutlass", "cutlass without a CUDA flavour", "both"])
def test_installed_builds_are_told_apart(tmp_path, monkeypatch, files, fa2, fa4):
    """flash-attn-4 leaves ``flash_attn`` a namespace package: that must not pass for FlashAttention-2; and
    FlashAttention-4 counts only with a CUDA flavour of the CuTe DSL (the H100 run met one without)."""
    import importlib
    import sys

    for name in ("flash_attn", "nvidia_cutlass_dsl"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    _fake_packages(tmp_path, *files)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert (flash_attn_backend.fa2_installed(), flash_attn_backend.fa4_installed()) == (fa2, fa4)
    reason = flash_attn_backend.FlashAttnBackend.available()
    if fa2 or fa4:
        assert reason is None
    elif any(name.startswith("flash_attn/cute") for name in files):
        assert reason.startswith("flash-attn-4 is installed, but the CuTe DSL it compiles with has no CUDA libraries")
    else:
        assert reason.startswith("the flash-attn package is not installed")


@pytest.mark.parametrize("major, installed, expected", [
    (9, {"fa2", "fa3", "fa4"}, "fa3"), (9, {"fa2", "fa4"}, "fa4"), (10, {"fa2", "fa3", "fa4"}, "fa4"),
    (8, {"fa2", "fa4"}, "fa2"), (8, {"fa4"}, None), (12, {"fa3", "fa4"}, None), (9, set(), None)])
def test_variant_by_compute_capability(monkeypatch, major, installed, expected):
    for name in ("fa2", "fa3", "fa4"):
        monkeypatch.setattr(flash_attn_backend, f"{name}_installed", lambda name=name: name in installed)
    assert flash_attn_backend.variant(major) == expected


def test_a_broken_install_is_reported_by_the_backend(monkeypatch):
    monkeypatch.setattr(flash_attn_backend, "variant", lambda capability_major=None: "fa4")

    def failing(name):
        raise RuntimeError("No CTK flavor installed")

    monkeypatch.setattr(flash_attn_backend.importlib, "import_module", failing)
    from dovetail.attention.backend import AttentionLayerSpec

    with pytest.raises(RuntimeError, match=r"FLASH_ATTN: importing flash_attn.cute \(fa4\) failed: No CTK flavor"):
        flash_attn_backend.FlashAttnImpl(AttentionLayerSpec(4, 2, 64, 0.125))


@pytest.mark.parametrize("version", ["fa4-hopper"], indirect=True)
def test_fa4_on_hopper_takes_head_sizes_the_triton_decode_takes(version):
    from dovetail.attention.backend import AttentionRequirements

    def reasons(head_size):
        return FlashAttnBackend.validate(AttentionRequirements("cuda", "cuda", torch.bfloat16, "auto", 16, head_size,
                                                               4, 2))

    assert reasons(64) == []
    assert any(r.startswith("head size 24 not supported by FLASH_ATTN with FlashAttention-4 on Hopper")
               for r in reasons(24)), reasons(24)
