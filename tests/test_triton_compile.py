"""The Triton kernels compile for real GPUs, checked on a machine without one.

The interpreter runs kernels as Python and accepts code the compiler rejects (a
module global that is not ``tl.constexpr``, a loop-carried value changing type).
This compiles every kernel ahead of time for sm_90 (H100/H200) and gfx942
(MI300) with triton's bundled compilers, twice: with no argument known to be
aligned, and as a GPU compiles it for the usual call (:func:`aligned_attrs`),
which takes other paths in the compiler (vectorised and asynchronous copies,
software pipelining). In that usual call no kernel but the grouped MoE GEMMs
(whose tiles a GPU picks among candidates) may spill registers on sm_90:
``default_config``'s tiles are chosen so. It runs in a subprocess because
``TRITON_INTERPRET=1``, set for the interpreter tests, decides at triton's import
how its own library is built. Run as a script, this file does the compiling:
``python tests/test_triton_compile.py cuda:90``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ATTENTION_TYPES = dict(
    split_out_ptr="*fp32", split_max_ptr="*fp32", split_sum_ptr="*fp32", block_table_ptr="*i32",
    seq_lens_ptr="*i32", query_start_loc_ptr="*i32", decode_order_ptr="*i32", num_seqs="i32", scale="fp32",
    softcap="fp32", window="i32")


def attention_variant(dtype, head_size, group, decode, split=False, softcap=False, window=False, rotary=0,
                      qk_norm=False, kv_fp8=False):
    from dovetail.triton import next_power_of_2
    from dovetail.triton.paged_attention import _paged_attention_kernel, default_config

    torch_dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]
    import torch

    cfg = default_config(head_size, group, decode, getattr(torch, torch_dtype), num_splits=2 if split else 1)
    ptr = "*" + dtype
    cache = "*fp8e4nv" if kv_fp8 else ptr
    types = dict(ATTENTION_TYPES, q_ptr=ptr, key_cache_ptr=cache, value_cache_ptr=cache, out_ptr=ptr, new_k_ptr=ptr,
                 new_v_ptr=ptr, slot_ptr="*i64", positions_ptr="*i64", cos_sin_ptr="*fp32", q_norm_ptr=ptr,
                 k_norm_ptr=ptr, eps="fp32")
    constexprs = dict(
        NUM_HEADS=8 * group, QUERIES_PER_KV=group, HEAD_SIZE=head_size, HEAD_PAD=next_power_of_2(head_size),
        BLOCK_SIZE=16, BLOCK_M=cfg.block_m, BLOCK_Q=1 if decode else cfg.block_m // group, TILE_N=cfg.tile_n,
        USE_SOFTCAP=softcap, USE_WINDOW=window, SPLIT_KV=split, IEEE_DOT=dtype == "fp32", DOT_IN_FP32=False,
        DECODE_ONLY=decode, WIDE_OFFSETS=False, HEADS_FASTEST=decode and cfg.heads_fastest,
        ORDERED=decode, NEW_KV=decode, ROTARY_HALF=rotary // 2, QK_NORM=qk_norm, NORM_WEIGHT_FP32=False,
        KV_FP8=kv_fp8, ROUND_FP8=False)
    return _paged_attention_kernel, types, constexprs, dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


ROTARY_TYPES = dict(positions_ptr="*i64", q_ptr="*bf16", k_ptr="*bf16", q_out_ptr="*bf16", k_out_ptr="*bf16",
                    cos_sin_ptr="*fp32", q_norm_ptr="*bf16", k_norm_ptr="*bf16", eps="fp32", v_ptr="*bf16",
                    key_cache_ptr="*bf16", value_cache_ptr="*bf16", slot_ptr="*i64")
ROTARY_LLAMA = dict(NUM_HEADS=32, NUM_KV_HEADS=8, HEADS_PAD=32, KV_HEADS_PAD=8, HEAD_SIZE=128, HALF=64, HALF_PAD=64,
                    NORM=False, WEIGHT_FP32=False, CACHE_WRITE=False, BLOCK_SIZE=1, HEAD_PAD=128)


def gemv_variant(weight, dot, split_k, block_n, block_k, num_stages, even=False, gated=False):
    from dovetail.triton.gemv import _gemv_kernel

    types = dict(x_ptr="*bf16", w_ptr="*fp8e4nv" if weight == "fp8" else "*bf16", scale_ptr="*fp32",
                 bias_ptr="*bf16", out_ptr="*bf16", part_ptr="*fp32", count_ptr="*i32")
    constexprs = dict(HAS_BIAS=True, SPLIT_K=split_k, BLOCK_M=16 if dot else 1, BLOCK_N=block_n, BLOCK_K=block_k,
                      DOT=dot, DOT_FP32=False, W_FP8=weight == "fp8", HAS_SCALE=weight == "fp8", PDL_TRIGGER=2,
                      EVEN=even, GATED=gated, GELU_TANH=False)
    return _gemv_kernel, types, constexprs, dict(num_warps=4, num_stages=num_stages)


NORM_TYPES = dict(x_ptr="*bf16", residual_ptr="*bf16", weight_ptr="*bf16", out_ptr="*bf16", summed_ptr="*bf16",
                  eps="fp32")
MOE_GEMM_TYPES = dict(c_ptr="*bf16", a_scale_ptr="*fp32", b_scale_ptr="*fp32", sorted_ptr="*i32",
                      block_expert_ptr="*i32", num_padded_ptr="*i32")


def moe_gemm_variant(dtype, gated, block_m, config, quant=0, pair_per_block=False, upcast=0):
    """The grouped GEMM of the fused MoE; ``quant`` 1: FP8 per-channel, 2: FP8 128x128 blocks; ``upcast`` 2: FP8 tiles
    multiplied as bfloat16 (GPUs without an FP8 product); ``config.tma``: weight tiles through a tensor descriptor."""
    from dovetail.triton.moe_gemm import _moe_gemm_kernel

    operand = "*fp8e4nv" if quant else f"*{dtype}"
    types = dict(MOE_GEMM_TYPES, a_ptr=operand, b_ptr=operand, c_ptr=f"*{dtype}",
                 sorted_ptr="*i64" if pair_per_block else "*i32")
    if config.tma:
        types["b_desc"] = f"tensordesc<{dtype}[{config.block_n}, {config.block_k}]>"
    constexprs = dict(A_ROW_DIV=8 if gated else 1, PAIR_PER_BLOCK=pair_per_block, HAS_MAP=pair_per_block,
                      GATED=gated, GELU_TANH=False, QUANT=quant, GROUP_N=128 if quant == 2 else 1,
                      GROUP_K=128 if quant == 2 else 1, IEEE=dtype == "fp32", UPCAST=upcast, BLOCK_M=block_m,
                      BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m, EVEN_K=True,
                      EVEN_N=False, B_TMA=config.tma)
    if not config.tma:
        constexprs["b_desc"] = None
    return _moe_gemm_kernel, types, constexprs, dict(num_warps=config.num_warps, num_stages=config.num_stages)


def moe_variants():
    from dovetail.triton import moe_align
    from dovetail.triton.moe_configs import gemm_candidates
    from dovetail.triton.moe_gemm import _moe_sum_kernel
    from dovetail.triton.moe_routing import _topk_softmax_kernel

    align = dict(ids_ptr="*i32", map_ptr="*i32", sorted_ptr="*i32", block_expert_ptr="*i32", num_padded_ptr="*i32",
                 counts_ptr="*i32", logits_ptr="*bf16", weights_ptr="*fp32")
    no_routing = dict(ROUTE=False, TOP_K=1, K_P2=1, RENORMALIZE=False, BLOCK_T=1, LOGITS_P2=1)
    routing = dict(TOP_K=8, K_P2=8, RENORMALIZE=True, LOGITS_P2=128)
    return {
        "moe routing 128 experts top 8": (_topk_softmax_kernel, dict(logits_ptr="*bf16", weights_ptr="*fp32",
                                                                      ids_ptr="*i32"),
                                          dict(TOP_K=8, K_P2=8, RENORMALIZE=True, BLOCK_T=16, BLOCK_E=128),
                                          dict(num_warps=4)),
        "moe align, one program": (moe_align._align_small_kernel, {**align, "scratch_ptr": "*i32"},
                                   dict(HAS_MAP=True, E_P2=128, BLOCK_M=16, CHUNK=256, BLOCKS_TILE=32, **no_routing),
                                   dict(num_warps=8)),
        "moe route and align, one program": (moe_align._align_small_kernel, {**align, "scratch_ptr": "*i32"},
                                             dict(HAS_MAP=True, E_P2=128, BLOCK_M=16, CHUNK=256, BLOCKS_TILE=32,
                                                  ROUTE=True, BLOCK_T=32, **routing), dict(num_warps=8)),
        "moe align: count": (moe_align._count_kernel, align, dict(HAS_MAP=False, CHUNK=1024), dict(num_warps=8)),
        "moe align: route and count": (moe_align._route_count_kernel, align,
                                       dict(HAS_MAP=True, BLOCK_T=16, **routing), dict(num_warps=4)),
        "moe align: place": (moe_align._place_kernel, align,
                             dict(HAS_MAP=True, E_P2=128, BLOCK_M=64, CHUNK=1024, BLOCKS_TILE=32),
                             dict(num_warps=8)),
        "moe gate/up bf16, one token": moe_gemm_variant("bf16", True, 16, gemm_candidates(16, True)[0],
                                                        pair_per_block=True),
        "moe gate/up bf16 prefill": moe_gemm_variant("bf16", True, 128, gemm_candidates(128, True)[0]),
        "moe down bf16 prefill": moe_gemm_variant("bf16", False, 64, gemm_candidates(64, False)[0]),
        "moe gate/up fp8 per channel": moe_gemm_variant("fp16", True, 16, gemm_candidates(16, True)[0], quant=1),
        "moe gate/up fp8 blocks": moe_gemm_variant("bf16", True, 64, gemm_candidates(64, True)[0], quant=2),
        "moe down fp8 blocks as bf16": moe_gemm_variant("bf16", False, 16, gemm_candidates(16, False)[0], quant=2,
                                                       upcast=2),
        "moe down fp32": moe_gemm_variant("fp32", False, 16, gemm_candidates(16, False)[1]),
        "moe gate/up bf16 prefill, weights through a tensor descriptor": moe_gemm_variant(
            "bf16", True, 128, gemm_candidates(128, True)[0]._replace(tma=True)),
        "moe down bf16 decode, weights through a tensor descriptor": moe_gemm_variant(
            "bf16", False, 16, gemm_candidates(16, False)[0]._replace(tma=True)),
        "moe sum with an expert map": (_moe_sum_kernel, dict(c_ptr="*bf16", w_ptr="*fp32", ids_ptr="*i32",
                                                             map_ptr="*i32", out_ptr="*bf16"),
                                       dict(TOP_K=8, HAS_MAP=True, BLOCK_H=1024), dict(num_warps=4)),
    }


def variants(pdl: bool = False):
    """Name -> (kernel, argument types, constexpr values, options), covering every branch.

    ``pdl``: compile with programmatic dependent launch (USE_PDL), as the CUDA platform launches them.
    """
    return {name: (kernel, types, dict(constexprs, USE_PDL=pdl), options)
            for name, (kernel, types, constexprs, options) in _variants().items()}


def _variants():
    from dovetail.triton.activation import _act_and_mul_kernel
    from dovetail.triton.argmax import _chunk_max_kernel, _row_max_kernel
    from dovetail.triton.kv_cache_write import _kv_cache_write_kernel
    from dovetail.triton.norm import _rms_norm_kernel
    from dovetail.triton.paged_attention import _reduce_splits_kernel
    from dovetail.triton.rotary import _rotary_kernel

    return {
        "attention prefill bf16 h128 gqa4 window softcap": attention_variant("bf16", 128, 4, False, softcap=True,
                                                                             window=True),
        "attention decode split bf16 h128 gqa2, q/k norms and rotary": attention_variant(
            "bf16", 128, 2, True, split=True, rotary=128, qk_norm=True),
        "attention decode bf16 h128 gqa4, rotary": attention_variant("bf16", 128, 4, True, rotary=128),
        "attention decode bf16 h128 gqa4": attention_variant("bf16", 128, 4, True),
        "attention prefill fp16 h80 gqa7": attention_variant("fp16", 80, 7, False),
        "attention prefill bf16 h256": attention_variant("bf16", 256, 2, False, window=True, softcap=True),
        "attention decode fp32 h64": attention_variant("fp32", 64, 1, True),
        "attention decode split bf16 h128 gqa4, fp8 cache": attention_variant("bf16", 128, 4, True, split=True,
                                                                              kv_fp8=True),
        "attention prefill bf16 h128 gqa4, fp8 cache": attention_variant("bf16", 128, 4, False, kv_fp8=True),
        "reduce splits": (_reduce_splits_kernel, dict(out_ptr="*bf16", split_out_ptr="*fp32", split_max_ptr="*fp32",
                                                      split_sum_ptr="*fp32", stride_ot="i32", stride_oh="i32"),
                          dict(NUM_HEADS=32, NUM_SPLITS=16, HEAD_SIZE=96, HEAD_PAD=128), dict(num_warps=4)),
        "kv cache write": (_kv_cache_write_kernel, dict(k_ptr="*bf16", v_ptr="*bf16", key_cache_ptr="*bf16",
                                                        value_cache_ptr="*bf16", slot_ptr="*i64"),
                           dict(NUM_KV_HEADS=8, HEAD_SIZE=128, BLOCK_SIZE=16, HEADS_PAD=8, HEAD_PAD=128,
                                KV_FP8=False, ROUND_FP8=False),
                           dict(num_warps=4)),
        "kv cache write, fp8 cache": (_kv_cache_write_kernel, dict(k_ptr="*bf16", v_ptr="*bf16",
                                                                   key_cache_ptr="*fp8e4nv",
                                                                   value_cache_ptr="*fp8e4nv", slot_ptr="*i64",
                                                                   k_scale="fp32", v_scale="fp32"),
                                      dict(NUM_KV_HEADS=8, HEAD_SIZE=128, BLOCK_SIZE=16, HEADS_PAD=8, HEAD_PAD=128,
                                           KV_FP8=True, ROUND_FP8=False),
                                      dict(num_warps=4)),
        "add rms norm": (_rms_norm_kernel, NORM_TYPES,
                         dict(HAS_RESIDUAL=True, WEIGHT_FP32=False, BLOCK=4096, HEADS=False, TOP_K=0),
                         dict(num_warps=8)),
        "experts' sum, add and rms norm": (_rms_norm_kernel, dict(NORM_TYPES, pair_weights_ptr="*fp32"),
                                           dict(HAS_RESIDUAL=True, WEIGHT_FP32=False, BLOCK=2048, HEADS=False,
                                                TOP_K=8),
                                           dict(num_warps=4)),
        "q/k norm of strided heads": (_rms_norm_kernel, NORM_TYPES,
                                      dict(HAS_RESIDUAL=False, WEIGHT_FP32=False, BLOCK=128, HEADS=True, TOP_K=0),
                                      dict(num_warps=1)),
        "silu and mul": (_act_and_mul_kernel, dict(x_ptr="*bf16", out_ptr="*bf16"),
                         dict(GELU_TANH=False, BLOCK=1024), dict(num_warps=4)),
        "gelu tanh and mul": (_act_and_mul_kernel, dict(x_ptr="*fp16", out_ptr="*fp16"),
                              dict(GELU_TANH=True, BLOCK=1024), dict(num_warps=4)),
        "rotary": (_rotary_kernel, ROTARY_TYPES, ROTARY_LLAMA, dict(num_warps=4)),
        "argmax chunks": (_chunk_max_kernel, dict(x_ptr="*bf16", value_ptr="*fp32", index_ptr="*i32"),
                          dict(BLOCK=4096), dict(num_warps=8)),
        "argmax rows": (_row_max_kernel, dict(value_ptr="*fp32", index_ptr="*i32", out_ptr="*i64"), dict(CHUNKS=32),
                        dict(num_warps=1)),
        "q/k norm and rotary": (_rotary_kernel, ROTARY_TYPES,
                                dict(ROTARY_LLAMA, NUM_HEADS=16, HEADS_PAD=16, NORM=True), dict(num_warps=4)),
        "q/k norm and rotary into the KV cache": (
            _rotary_kernel, ROTARY_TYPES,
            dict(ROTARY_LLAMA, NUM_HEADS=16, HEADS_PAD=16, NORM=True, CACHE_WRITE=True, BLOCK_SIZE=16),
            dict(num_warps=4)),
        "gemv fp8 dot split-k": gemv_variant("fp8", True, 4, 64, 128, 3),
        "gemv fp8 dot, tiles dividing the weight": gemv_variant("fp8", True, 4, 64, 256, 3, even=True),
        "gemv bf16 register sums": gemv_variant("bf16", False, 1, 8, 1024, 3),
        "gemv bf16 gated register sums (one token)": gemv_variant("bf16", False, 1, 4, 1024, 3, even=True, gated=True),
        "gemv bf16 gated dot split-k": gemv_variant("bf16", True, 2, 32, 128, 3, gated=True),
        **moe_variants(),
    }


def _signature(kernel, types: dict[str, str], constexprs: dict) -> dict[str, str]:
    """Each argument's triton type: ``constexpr``, its entry in ``types``, else ``i32``."""
    return {arg: "constexpr" if arg in constexprs else types.get(arg, "i32") for arg in kernel.arg_names}


def aligned_attrs(kernel, signature: dict[str, str]) -> dict:
    """The specialisation triton's launcher gives a call whose tensors start 16-byte aligned and whose integer
    arguments (strides, sizes) are multiples of 16: every argument but those the kernel keeps from it
    (``do_not_specialize``, ``do_not_specialize_on_alignment``)."""
    attrs = {}
    for index, param in enumerate(kernel.params):
        kind = signature[param.name]
        if kind == "constexpr" or param.do_not_specialize or kind.startswith("fp"):
            continue
        if kind.startswith("*") and getattr(param, "do_not_specialize_on_alignment", False):
            continue
        attrs[(index,)] = [["tt.divisibility", 16]]
    return attrs


def spilled_bytes(cubin: bytes) -> int | None:
    """Bytes of stack and local memory (register spills) of the one kernel in ``cubin``, by the
    ``cuobjdump`` triton bundles; None without it."""
    import re
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"STACK:(\d+) .*LOCAL:(\d+)", usage)
    return int(found.group(1)) + int(found.group(2)) if found else None


def compile_all(target_name: str) -> dict[str, dict]:
    """Compile every variant for ``cuda:<arch>`` or ``hip:<arch>``, unaligned and aligned.

    Returns ``errors`` (name -> "ok" or the error) and, for CUDA's aligned variants, ``spills`` (name -> bytes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    backend, arch = target_name.split(":")
    target = GPUTarget(backend, int(arch) if backend == "cuda" else arch, 32 if backend == "cuda" else 64)
    errors, spills = {}, {}
    for name, (kernel, types, constexprs, options) in variants(pdl=backend == "cuda").items():
        signature = _signature(kernel, types, constexprs)
        for label, attrs in ((name, None), (f"{name}, aligned", aligned_attrs(kernel, signature))):
            try:
                compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                          options=options)
                errors[label] = "ok"
            except Exception as exc:  # reported back to the test, which names the variant
                errors[label] = f"{type(exc).__name__}: {exc}"
                continue
            if attrs is not None and backend == "cuda":
                spills[name] = spilled_bytes(compiled.asm["cubin"])
    return {"errors": errors, "spills": spills}


def specialised_attention_args() -> list[str]:
    """The arguments of a split decode attention launch that :func:`aligned_attrs` specialises."""
    kernel, types, constexprs, _ = attention_variant("bf16", 128, 4, True, split=True)
    return [kernel.arg_names[index] for (index,) in aligned_attrs(kernel, _signature(kernel, types, constexprs))]


def _compiler_env() -> dict[str, str]:
    """The environment of this file run as a script: without ``TRITON_INTERPRET`` (kernels are then triton's JIT
    functions)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return env


def _run_compiler_script(*args: str) -> subprocess.CompletedProcess:
    """This file as a script (:func:`_compiler_env`)."""
    return subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=_compiler_env(),
                          timeout=600)


def test_aligned_variants_specialise_what_the_launcher_would():
    pytest.importorskip("triton")
    result = _run_compiler_script("aligned-args")
    if result.returncode == 3:
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stderr[-3000:]
    specialised = set(json.loads(result.stdout.splitlines()[-1]))
    assert {"q_ptr", "key_cache_ptr", "stride_cache_block", "stride_qt"} <= specialised
    # per-step pointers callers slice, integers the kernel keeps general, floats and constexprs are left alone
    assert not specialised & {"block_table_ptr", "seq_lens_ptr", "num_seqs", "stride_table", "scale", "HEAD_SIZE"}


TARGETS = ["cuda:90", "hip:gfx942"]


@pytest.fixture(scope="module")
def compilations(tmp_path_factory):
    """Both targets' compilations, started together at the first test that needs one: each is one process, so on
    a machine of two cores the second compiles beside the first instead of after it. Output goes to files, so that
    neither process waits on a pipe nobody reads yet."""
    pytest.importorskip("triton")
    env = _compiler_env()
    directory = tmp_path_factory.mktemp("triton-compile")
    running = {}
    for target in TARGETS:
        out, err = (open(directory / f"{target.replace(':', '-')}.{kind}", "w+") for kind in ("out", "err"))
        running[target] = (subprocess.Popen([sys.executable, __file__, target], stdout=out, stderr=err, text=True,
                                            env=env), out, err)
    yield running
    for process, out, err in running.values():
        if process.poll() is None:
            process.kill()
            process.wait()
        out.close()
        err.close()


def _finished(running) -> subprocess.CompletedProcess:
    process, out, err = running
    try:
        process.wait(timeout=600)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    out.seek(0)
    err.seek(0)
    return subprocess.CompletedProcess(process.args, process.returncode, out.read(), err.read())


@pytest.mark.parametrize("target", TARGETS)
def test_kernels_compile_for(target, compilations):
    result = _finished(compilations[target])
    if result.returncode == 3:
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    failures = {name: error for name, error in report["errors"].items() if error != "ok"}
    assert not failures, "\n\n".join(f"{name}:\n{error}" for name, error in failures.items())
    # The grouped MoE GEMMs' tiles are chosen on the GPU among candidates (moe_tuner), which may spill.
    spilling = {name: size for name, size in report["spills"].items()
                if size and not name.startswith(("moe gate/up", "moe down"))}
    assert not spilling, f"register spills (bytes) on {target} in the usual call: {spilling}"


if __name__ == "__main__":
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as exc:
        print(f"this triton cannot compile ahead of time here ({exc})")
        sys.exit(3)
    print(json.dumps(specialised_attention_args() if sys.argv[1] == "aligned-args" else compile_all(sys.argv[1])))
