"""The cuda platform without a GPU: the NVML probe, CUDA_VISIBLE_DEVICES, selection order, validation reasons."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest
import torch

from dovetail import selection, testing
from dovetail.attention.backend import AttentionRequirements
from dovetail.plugin_manager import get_plugin_manager
from dovetail_cuda import flash_attn_backend, probe
from dovetail_cuda.flash_attn_backend import FlashAttnBackend
from dovetail_cuda.flashinfer_backend import FlashInferBackend
from dovetail_cuda.nvml import GpuInfo, Nvml, NvmlError
from dovetail_cuda.platform import CudaPlatform

H200 = [GpuInfo(0, "NVIDIA H200", "GPU-aaaa1111", (9, 0), 143771 * 2**20),
        GpuInfo(1, "NVIDIA H200", "GPU-bbbb2222", (9, 0), 143771 * 2**20),
        GpuInfo(2, "NVIDIA A100-SXM4-80GB", "GPU-cccc3333", (8, 0), 80 * 2**30)]


class FakeNvmlLibrary:
    """Answers the NVML entry points nvml.Nvml calls, through the ctypes arguments it passes."""

    def __init__(self, gpus, init_code=0):
        self.gpus, self.init_code, self.calls = gpus, init_code, []

    def nvmlInit_v2(self):
        self.calls.append("init")
        return self.init_code

    def nvmlShutdown(self):
        self.calls.append("shutdown")
        return 0

    def nvmlErrorString(self, code):
        return b"Driver Not Loaded"

    def nvmlSystemGetDriverVersion(self, buf, size):
        buf.value = b"580.159.04"
        return 0

    def nvmlDeviceGetCount_v2(self, count):
        count._obj.value = len(self.gpus)
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
        handle._obj.value = index.value + 1
        return 0

    def _gpu(self, handle):
        return self.gpus[handle.value - 1]

    def nvmlDeviceGetName(self, handle, buf, size):
        buf.value = self._gpu(handle).name.encode()
        return 0

    def nvmlDeviceGetUUID(self, handle, buf, size):
        buf.value = self._gpu(handle).uuid.encode()
        return 0

    def nvmlDeviceGetCudaComputeCapability(self, handle, major, minor):
        major._obj.value, minor._obj.value = self._gpu(handle).capability
        return 0

    def nvmlDeviceGetMemoryInfo(self, handle, memory):
        memory._obj.total = self._gpu(handle).memory_total
        return 0

    def nvmlDeviceGetHandleByUUID(self, uuid, handle):
        index = [g.uuid.encode() for g in self.gpus].index(uuid)
        handle._obj.value = index + 1
        return 0

    #: Pairs of GPU indices joined by NVLink (``nvmlDeviceGetP2PStatus`` with the NVLink index answers OK).
    nvlinks = {frozenset((0, 1))}

    def nvmlDeviceGetP2PStatus(self, first, second, caps_index, status):
        assert caps_index.value == 2, "asks about NVLink"
        pair = frozenset((first.value - 1, second.value - 1))
        status._obj.value = 0 if pair in self.nvlinks else 4  # NVML_P2P_STATUS_NOT_SUPPORTED
        return 0


def test_nvml_session_reads_every_gpu_through_ctypes():
    lib = FakeNvmlLibrary(H200)
    with Nvml(lib) as nvml:
        assert nvml.gpus() == H200
        assert nvml.driver_version() == "580.159.04"
    assert lib.calls == ["init", "shutdown"]


def test_nvml_says_which_gpus_are_joined_by_nvlink():
    uuids = [gpu.uuid for gpu in H200]
    with Nvml(FakeNvmlLibrary(H200)) as nvml:
        assert nvml.nvlink_connected(uuids[0], uuids[:2])
        assert nvml.nvlink_connected(uuids[1], [uuids[1]]), "a GPU needs no link to itself"
        assert not nvml.nvlink_connected(uuids[0], uuids), "GPU 2 is reached over PCIe only"
        assert not nvml.nvlink_connected(uuids[2], uuids[:1])


def test_nvml_error_names_the_call_and_the_driver_message():
    with pytest.raises(NvmlError, match=r"nvmlInit_v2 failed with error 9: Driver Not Loaded"):
        with Nvml(FakeNvmlLibrary(H200, init_code=9)):
            pass


@pytest.mark.parametrize("value, expected", [
    (None, [0, 1, 2]),
    ("", []),
    ("1", [1]),
    ("2,0", [2, 0]),
    ("1,7,0", [1]),  # CUDA stops at the first entry that names no GPU
    ("0,0", [0]),  # a repeated device ends the list too
    ("-1", []),
    ("GPU-cccc", [2]),
    ("bbbb2222,0", [1, 0]),
    ("GPU-", []),  # an ambiguous UUID prefix names no GPU
])
def test_cuda_visible_devices_is_read_as_the_cuda_runtime_reads_it(value, expected):
    env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    visible, mig = probe.visible_gpus(H200, env)
    assert [g.index for g in visible] == expected and mig == 0


def _fake_factory(gpus):
    return lambda: Nvml(FakeNvmlLibrary(gpus))


def test_probe_without_driver_says_why(monkeypatch):
    def no_driver():
        raise NvmlError("NVML (libnvidia-ml.so.1) cannot be loaded: not found")

    devices = probe.find_devices(no_driver, env={})
    assert devices.problem.startswith("no NVIDIA driver: NVML (libnvidia-ml.so.1) cannot be loaded")


def test_probe_needs_a_cuda_build_of_torch(monkeypatch):
    monkeypatch.setattr(probe, "_torch_build", lambda: (None, "this torch is a CPU-only build"))
    devices = probe.find_devices(_fake_factory(H200), env={})
    assert devices.problem == "this torch is a CPU-only build"


def test_probe_reports_gpus_hidden_by_cuda_visible_devices(monkeypatch):
    monkeypatch.setattr(probe, "_torch_build", lambda: ("13.0", ""))
    devices = probe.find_devices(_fake_factory(H200), env={"CUDA_VISIBLE_DEVICES": "1"})
    assert not devices.problem
    assert devices.summary() == ("1 x NVIDIA H200 (sm_90, 140 GiB), 2 hidden by CUDA_VISIBLE_DEVICES; "
                                 "driver 580.159.04, torch CUDA 13.0")
    hidden = probe.find_devices(_fake_factory(H200), env={"CUDA_VISIBLE_DEVICES": ""})
    assert hidden.problem == "3 NVIDIA GPU(s) present but none visible with CUDA_VISIBLE_DEVICES=''"
    assert probe.find_devices(_fake_factory([]), env={}).problem == "the NVIDIA driver reports no GPU"


def test_probe_here_is_unusable_with_a_reason_and_does_not_start_cuda():
    program = ("import torch; from dovetail_cuda.probe import probe; r = probe(); "
               "print(r.usable, torch.cuda.is_initialized()); print(r.reason)")
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    first, reason = result.stdout.splitlines()[:2]
    if torch.cuda.is_available():
        assert first == "True False"
    else:
        assert first == "False False" and reason


def test_importing_the_plugin_and_its_backends_touches_no_device():
    testing.check_import_is_cheap("dovetail_cuda.plugin", "dovetail_cuda.platform",
                                  "dovetail_cuda.flashinfer_backend", "dovetail_cuda.flash_attn_backend")


def test_platform_contract():
    platform = testing.check_platform(CudaPlatform)
    assert (platform is None) == (not torch.cuda.is_available())


def test_dovetail_plugins_lists_cuda_and_its_backends_with_reasons():
    from dovetail.cli.plugins_cmd import collect

    data = collect()
    cuda = data["platforms"]["cuda"]
    assert cuda["plugin"] == "cuda" and cuda["priority"] == 100
    backends = data["attention_backends"]
    assert backends["FLASHINFER"]["platforms"] == ["cuda"] and backends["FLASH_ATTN"]["platforms"] == ["cuda"]
    assert "FlashAttention-4 verified on one NVIDIA H100" in backends["FLASH_ATTN"]["verification"]
    assert "FlashAttention-2 and FlashAttention-3 NOT verified" in backends["FLASH_ATTN"]["verification"]
    assert "Blackwell" in backends["FLASH_ATTN"]["verification"]
    if not torch.cuda.is_available():
        assert cuda["usable"] is False and "no NVIDIA driver" in cuda["reason"] or "torch" in cuda["reason"]
        assert backends["FLASHINFER"]["usable"] is False and backends["FLASHINFER"]["reason"]


def _requirements(**overrides):
    values = dict(platform="cuda", device_type="cuda", dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16,
                  head_size=128, num_heads=32, num_kv_heads=8)
    values.update(overrides)
    return AttentionRequirements(**values)


@pytest.fixture
def installed(monkeypatch):
    """Pretend FlashInfer and FlashAttention-2 (not 3 or 4) are installed."""
    monkeypatch.setattr(FlashInferBackend, "available", classmethod(lambda cls: None))
    monkeypatch.setattr(flash_attn_backend, "fa2_installed", lambda: True)
    monkeypatch.setattr(flash_attn_backend, "fa3_installed", lambda: False)
    monkeypatch.setattr(flash_attn_backend, "fa4_installed", lambda: False)


def test_auto_selection_order_on_cuda(installed):
    manager = get_plugin_manager()
    platform = CudaPlatform()
    assert platform.default_attention_backends() == ["FLASH_ATTN", "FLASHINFER", "TRITON", "REFERENCE"]
    order = selection.attention_backend_candidates(platform, manager)
    assert order[:4] == ["FLASH_ATTN", "FLASHINFER", "TRITON", "REFERENCE"]
    # FlashAttention-2 needs blocks of 256: with 16 the next backend, FLASHINFER, is chosen.
    assert selection.select_attention_backend(platform, _requirements(), None, manager) is FlashInferBackend
    assert selection.select_attention_backend(platform, _requirements(block_size=256), None, manager) \
        is FlashAttnBackend
    # A head size FlashInfer does not take goes to the next one.
    assert selection.select_attention_backend(platform, _requirements(head_size=96), None, manager).name == "TRITON"


def test_on_hopper_auto_selection_puts_the_fastest_measured_backend_first(installed, monkeypatch):
    import re
    from pathlib import Path

    from dovetail_cuda import platform as cuda_platform

    manager = get_plugin_manager()
    monkeypatch.setattr(cuda_platform, "visible_capability_major", lambda: 9)
    platform = CudaPlatform()
    assert platform.default_attention_backends() == ["TRITON", "FLASH_ATTN", "FLASHINFER", "REFERENCE"]
    assert selection.attention_backend_candidates(platform, manager)[:4] == [
        "TRITON", "FLASH_ATTN", "FLASHINFER", "REFERENCE"]
    assert selection.select_attention_backend(platform, _requirements(), None, manager).name == "TRITON"
    reason = platform.attention_backend_order_reason()
    assert reason.startswith("on Hopper TRITON comes first") and "benchmarks/RESULTS.md" in reason
    results = (Path(__file__).resolve().parents[1] / "benchmarks" / "RESULTS.md").read_text()
    figures = re.findall(r"\d+,\d{3}", reason)
    assert len(figures) == 6 and all(figure in results for figure in figures)
    monkeypatch.setattr(cuda_platform, "visible_capability_major", lambda: 8)
    assert platform.default_attention_backends() == ["FLASH_ATTN", "FLASHINFER", "TRITON", "REFERENCE"]
    assert platform.attention_backend_order_reason().startswith("not measured on sm_8x")


def test_validation_reasons_name_the_backend_and_the_rule(installed):
    assert FlashInferBackend.validate(_requirements()) == []
    reasons = FlashInferBackend.validate(_requirements(head_size=80, dtype=torch.float32, num_heads=12,
                                                       num_kv_heads=5))
    assert "head size 80 not supported by FLASHINFER (supported: 64, 128, 256)" in reasons
    assert "dtype float32 not supported by FLASHINFER (supported: float16, bfloat16)" in reasons
    assert "num_heads (12) must be a multiple of num_kv_heads (5) for FLASHINFER" in reasons
    assert FlashInferBackend.validate(_requirements(device_type="cpu"))[0].startswith(
        "device type 'cpu' not supported by FLASHINFER")
    assert FlashAttnBackend.validate(_requirements()) == [
        "block size 16 not supported by FLASH_ATTN with FlashAttention-2 (its paged cache needs a multiple of "
        "256: --block-size 256)"]
    assert FlashAttnBackend.validate(_requirements(block_size=512)) == []


def test_missing_packages_are_the_reason(monkeypatch):
    monkeypatch.setattr(flash_attn_backend, "fa2_installed", lambda: False)
    monkeypatch.setattr(flash_attn_backend, "fa3_installed", lambda: False)
    monkeypatch.setattr(flash_attn_backend, "fa4_installed", lambda: False)
    assert FlashAttnBackend.validate(_requirements())[0].startswith("the flash-attn package is not installed")
    import importlib.util

    if importlib.util.find_spec("flashinfer") is None:
        assert FlashInferBackend.validate(_requirements())[0] == (
            "the flashinfer-python package is not installed (pip install flashinfer-python)")


def test_flash_attn_request_sets_block_size_256_unless_the_user_chose_one(installed):
    from dovetail.config import EngineArgs

    config = EngineArgs("m", attention_backend="FLASH_ATTN").create_engine_config()
    CudaPlatform().check_and_update_config(config)
    assert config.cache.block_size == 256
    config = EngineArgs("m", attention_backend="FLASH_ATTN", block_size=32).create_engine_config()
    CudaPlatform().check_and_update_config(config)
    assert config.cache.block_size == 32
    config = EngineArgs("m").create_engine_config()
    CudaPlatform().check_and_update_config(config)
    assert config.cache.block_size == 16


@pytest.mark.parametrize("memory_gib, name, llm, server", [
    (141, "NVIDIA H200", (16384, 1024), (8192, 1024)),
    (80, "NVIDIA A100-SXM4-80GB", (8192, 256), (8192, 256)),
    (24, "NVIDIA L4", (8192, 256), (8192, 256)),
])
def test_batch_defaults_follow_vllm_by_device(monkeypatch, memory_gib, name, llm, server):
    """Read through NVML, so the engine's process opens no CUDA context; from torch only for MIG slices."""
    gpu = GpuInfo(0, name, "GPU-dddd4444", (9, 0), memory_gib * 2**30)
    monkeypatch.setattr(probe, "find_devices", lambda: probe.CudaDevices("13.0", "580", [gpu], [gpu]))

    def no_context(*args, **kwargs):
        raise AssertionError("a CUDA context opened in the engine's process")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_context)
    monkeypatch.setattr(torch.cuda, "get_device_name", no_context)
    platform = CudaPlatform.__new__(CudaPlatform)
    assert platform.default_batch_limits("llm") == llm and platform.default_batch_limits("server") == server
    monkeypatch.setattr(probe, "find_devices", lambda: probe.CudaDevices("13.0", "580", [gpu], [], mig=1))
    monkeypatch.setattr(CudaPlatform, "memory_total", lambda self, index=0: memory_gib * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: name)
    assert platform.default_batch_limits("llm") == llm and platform.default_batch_limits("server") == server


def test_selecting_the_device_picks_cublaslt_unless_told_otherwise(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: chosen.append(("device", index)))
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", lambda library: chosen.append(library))
    monkeypatch.delenv("DOVETAIL_CUDA_BLAS", raising=False)
    CudaPlatform().set_device(0)
    monkeypatch.setenv("DOVETAIL_CUDA_BLAS", "cuBLAS")
    CudaPlatform().set_device(1)
    assert chosen == [("device", 0), "cublaslt", ("device", 1), "cublas"]
    monkeypatch.setenv("DOVETAIL_CUDA_BLAS", "mkl")
    with pytest.raises(ValueError, match="DOVETAIL_CUDA_BLAS='mkl': expected 'cublaslt' or 'cublas'"):
        CudaPlatform().set_device(0)
    assert len(chosen) == 4  # nothing selected


def test_flash_attn_4_on_hopper_keeps_the_block_size(monkeypatch):
    from dovetail.config import EngineArgs

    monkeypatch.setattr(flash_attn_backend, "fa2_installed", lambda: False)
    monkeypatch.setattr(flash_attn_backend, "fa3_installed", lambda: False)
    monkeypatch.setattr(flash_attn_backend, "fa4_installed", lambda: True)
    monkeypatch.setattr(CudaPlatform, "capability", lambda self, index=0: (9, 0))
    config = EngineArgs("m", attention_backend="FLASH_ATTN").create_engine_config()
    CudaPlatform().check_and_update_config(config)
    assert config.cache.block_size == 16
    monkeypatch.setattr(flash_attn_backend, "variant", lambda capability_major=None: "fa4")
    assert FlashAttnBackend.validate(_requirements()) == []
    monkeypatch.setattr(flash_attn_backend, "variant", lambda capability_major=None: None)
    assert "does not run on this GPU" in FlashAttnBackend.validate(_requirements())[0]


def test_hopper_runs_linears_of_up_to_dovetail_gemv_max_rows_tokens_on_the_triton_gemv(monkeypatch):
    from dovetail.errors import ConfigError
    from dovetail.triton.fused_ops import GATED_GEMV_MAX_ROWS, GEMV_MAX_ROWS

    monkeypatch.setattr(CudaPlatform, "capability", lambda self, index=0: (9, 0))
    monkeypatch.delenv("DOVETAIL_GEMV_MAX_ROWS", raising=False)
    assert CudaPlatform().fused_ops().gemv_max_rows == GEMV_MAX_ROWS
    monkeypatch.setenv("DOVETAIL_GEMV_MAX_ROWS", "256")
    assert CudaPlatform().fused_ops().gemv_max_rows == 256
    monkeypatch.setenv("DOVETAIL_GEMV_MAX_ROWS", "0")
    assert CudaPlatform().fused_ops().gemv_max_rows == 0
    monkeypatch.setenv("DOVETAIL_GEMV_MAX_ROWS", "-3")
    with pytest.raises(ConfigError, match="DOVETAIL_GEMV_MAX_ROWS='-3': expected a whole number"):
        CudaPlatform().fused_ops()
    monkeypatch.setenv("DOVETAIL_GEMV_MAX_ROWS", "1")
    monkeypatch.delenv("DOVETAIL_GATED_GEMV_MAX_ROWS", raising=False)
    assert CudaPlatform().fused_ops().gated_gemv_max_rows == GATED_GEMV_MAX_ROWS
    monkeypatch.setenv("DOVETAIL_GATED_GEMV_MAX_ROWS", "64")
    assert CudaPlatform().fused_ops().gated_gemv_max_rows == 64
    monkeypatch.setenv("DOVETAIL_GATED_GEMV_MAX_ROWS", "many")
    with pytest.raises(ConfigError, match="DOVETAIL_GATED_GEMV_MAX_ROWS='many': expected a whole number"):
        CudaPlatform().fused_ops()
    monkeypatch.setattr(CudaPlatform, "capability", lambda self, index=0: (8, 0))
    monkeypatch.setenv("DOVETAIL_GEMV_MAX_ROWS", "256")
    monkeypatch.setenv("DOVETAIL_GATED_GEMV_MAX_ROWS", "64")
    ops = CudaPlatform().fused_ops()
    assert ops.gemv_max_rows == 0 and ops.gated_gemv_max_rows == 0, "cuBLAS before Hopper"


def test_micro_batches_run_their_products_on_cublas_and_restore_the_library(monkeypatch):
    """cuBLASLt's Hopper kernels hold every multiprocessor, so two overlapped micro-batches use cuBLAS; the
    library the engine chose comes back afterwards, also after an error."""
    chosen = ["cublaslt"]

    def preferred_blas_library(library=None):
        if library is not None:
            chosen.append(library)
        return chosen[-1]

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred_blas_library)
    with CudaPlatform().micro_batches_context():
        assert chosen[-1] == "cublas"
    assert chosen == ["cublaslt", "cublas", "cublaslt"]
    with pytest.raises(ValueError), CudaPlatform().micro_batches_context():
        raise ValueError("a failed step")
    assert chosen[-1] == "cublaslt"
