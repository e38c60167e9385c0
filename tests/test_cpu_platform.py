"""The cpu platform: contract, threads, KV-cache budget, dtypes, ISA dispatch and what `dovetail plugins` shows."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dovetail import testing
from dovetail.config import DEFAULT_KV_CACHE_BYTES, EngineArgs
from dovetail.errors import ConfigError
from dovetail_cpu import cpu_info, isa
from dovetail_cpu.ops import CpuFusedOps
from dovetail_cpu.platform import CpuPlatform


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _config(**kwargs):
    return EngineArgs("unused", **kwargs).create_engine_config()


def test_platform_contract_and_fused_ops():
    platform = testing.check_platform(CpuPlatform)
    assert isinstance(platform.fused_ops(), CpuFusedOps)
    assert platform.default_attention_backends()[0] == "CPU_SIMD"
    assert "REFERENCE" in platform.default_attention_backends()
    assert isa.selected_isa() in platform.describe()


def test_cpu_threads_flag_wins_over_omp_num_threads(monkeypatch, restore_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    config = _config(cpu_threads=1)
    CpuPlatform().check_and_update_config(config)
    assert torch.get_num_threads() == 1
    assert config.device.enforce_eager


def test_omp_num_threads_is_honoured(monkeypatch, restore_threads):
    torch.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "1,1")
    CpuPlatform().check_and_update_config(_config())
    assert torch.get_num_threads() == 1


def test_default_threads_are_the_usable_cores(monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    CpuPlatform().check_and_update_config(_config())
    assert torch.get_num_threads() == cpu_info.usable_cores()


def test_bad_omp_num_threads_is_named(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "many")
    with pytest.raises(ConfigError, match="OMP_NUM_THREADS"):
        CpuPlatform().check_and_update_config(_config())


def test_kv_cache_budget_in_bytes():
    platform = CpuPlatform()
    assert platform.kv_cache_bytes(_config(kv_cache_memory_bytes=12345678), lambda: 0) == 12345678
    default = platform.kv_cache_bytes(_config(), lambda: 0)
    assert 0 < default <= DEFAULT_KV_CACHE_BYTES


def test_bf16_offered_exactly_when_the_cpu_has_it():
    assert (torch.bfloat16 in CpuPlatform().supported_dtypes()) == cpu_info.has_bf16()


def test_unknown_isa_lists_the_compiled_ones():
    with pytest.raises(ConfigError, match="unknown CPU ISA 'sse9'.*portable"):
        isa.select_isa("sse9")
    assert isa.selected_isa() in isa.supported_isas()


def test_isa_this_cpu_lacks_is_refused():
    lacking = [name for name in isa.compiled_isas() if name not in isa.supported_isas()]
    if not lacking:
        pytest.skip(f"this CPU runs every compiled path ({', '.join(isa.compiled_isas())})")
    with pytest.raises(ConfigError, match="cannot run"):
        isa.select_isa(lacking[0])


def test_auto_picks_the_best_path():
    before = isa.selected_isa()
    try:
        assert isa.select_isa("auto") == isa.supported_isas()[0]
        flags = cpu_info.cpu_flags()
        if "avx512_bf16" in flags:
            assert isa.selected_isa() == "avx512_bf16"
        elif {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
            assert isa.selected_isa() == "avx512"
        elif {"avx2", "fma"} <= flags:
            assert isa.selected_isa() == "avx2"
    finally:
        isa.select_isa(before)


def _run(code: str, **env) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, **env})
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_env_var_forces_the_path_and_dovetail_plugins_reports_it():
    out = _run("from dovetail.cli.main import main; main(['plugins'])", DOVETAIL_CPU_ISA="portable")
    assert "CPU_SIMD" in out and "kernel path here: portable" in out
    assert "attention backend: CPU_SIMD" in out


@pytest.mark.parametrize("path", ["avx512", "avx2", "portable"])
def test_forced_path_behaves_as_a_cpu_whose_best_path_it_is(path):
    """Forcing a path hides the faster ones, so the suite run that way proves what such a CPU would do."""
    if path not in isa.supported_isas():
        pytest.skip(f"this CPU (or build) lacks the {path} path; it runs: {', '.join(isa.supported_isas())}")
    out = _run("import json, torch; from dovetail_cpu import cpu_info, isa; "
               "from dovetail_cpu.platform import CpuPlatform; "
               "print(json.dumps({'selected': isa.selected_isa(), 'supported': isa.supported_isas(), "
               "'auto': isa.select_isa('auto'), 'flags': sorted(cpu_info.cpu_flags()), "
               "'dtypes': [str(d) for d in CpuPlatform().supported_dtypes()], 'probe': cpu_info.probe().reason}))",
               DOVETAIL_CPU_ISA=path)
    import json

    seen = json.loads(out.strip().splitlines()[-1])
    order = list(cpu_info.ISA_ORDER)
    assert seen["selected"] == seen["auto"] == path
    assert seen["supported"] == [p for p in isa.supported_isas() if order.index(p) >= order.index(path)]
    assert seen["dtypes"] == ["torch.float32"], "bfloat16 is offered only where the CPU has AVX-512 BF16"
    assert not any(f.startswith("avx512_bf16") or f.startswith("amx") for f in seen["flags"])
    if path != "avx512":
        assert not any(f.startswith("avx512") for f in seen["flags"])
        assert f"capped at {path}" in seen["probe"] and "avx512" not in seen["probe"]
    if path == "portable":
        assert "avx2" not in seen["flags"] and "fma" not in seen["flags"]


def test_faster_path_than_the_forced_one_is_refused(monkeypatch):
    monkeypatch.setenv("DOVETAIL_CPU_ISA", "portable")
    with pytest.raises(ConfigError, match="cannot run the 'avx2' kernels.*DOVETAIL_CPU_ISA=portable caps it"):
        isa.select_isa("avx2")
    assert isa.supported_isas() == ["portable"]


def test_suite_under_a_forced_path_runs_torch_at_that_level_too():
    forced = cpu_info.isa_ceiling()
    if forced is None:
        pytest.skip("DOVETAIL_CPU_ISA is not set: torch runs at the CPU's own level")
    expected = {"avx512_bf16": "AVX512", "avx512": "AVX512", "avx2": "AVX2", "portable": "DEFAULT"}[forced]
    assert torch.backends.cpu.get_cpu_capability() == expected


def test_int8_products_are_exact_whatever_the_cpu_has():
    """torch._int_mm saturates on CPUs without VNNI (oneDNN's AVX2 kernels); the platform's kernels never do."""
    kernels = CpuPlatform().quant_kernels()
    assert kernels.uses_int_mm == cpu_info.has_int8_dot_product()
    gen = torch.Generator().manual_seed(0)
    for k in (64, 1024, 3000):
        a = torch.randint(-127, 128, (5, k), generator=gen, dtype=torch.int8)
        b = torch.randint(-127, 128, (24, k), generator=gen, dtype=torch.int8)
        a[0], b[0] = 127, -127  # the largest partial sums
        out = kernels.int8_matmul(a, b)
        assert out.dtype == torch.int32
        assert torch.equal(out, (a.long() @ b.long().t()).int()), f"K={k}"


def test_int8_dot_products_are_hidden_below_avx512_when_forced(monkeypatch):
    monkeypatch.setenv("DOVETAIL_CPU_ISA", "avx2")
    assert not cpu_info.has_int8_dot_product(), "the plainest AVX2 CPU (Haswell to Zen 3) has no VNNI"
    assert CpuPlatform().quant_kernels().uses_int_mm is False


def test_importing_the_plugin_loads_no_kernels():
    out = _run("import sys, dovetail_cpu.plugin; from dovetail.plugin_manager import get_plugin_manager; "
               "get_plugin_manager(); print('dovetail_cpu._native' in sys.modules, 'torch' in sys.modules)")
    assert out.split()[0] == "False"


def test_dovetail_plugins_says_why_the_chosen_backend_comes_first(monkeypatch):
    import re
    from pathlib import Path

    from dovetail.cli.plugins_cmd import collect, render

    monkeypatch.delenv("DOVETAIL_DEVICE", raising=False)
    data = collect()
    auto = data["auto_selection"]
    assert auto["device"] == "cpu" and auto["attention_backend"] == "CPU_SIMD"
    assert auto["order_reason"] == CpuPlatform().attention_backend_order_reason()
    assert auto["order_reason"].startswith("CPU_SIMD comes first")
    assert f"  why this order: {auto['order_reason']}" in render(data).splitlines()
    results = (Path(__file__).resolve().parents[1] / "benchmarks" / "RESULTS.md").read_text()
    assert re.findall(r"\b\d{3}\b", auto["order_reason"]) == ["711", "497"]
    assert "**711.0** (CPU_SIMD), REFERENCE 496.9" in results  # the C1 row these figures round
