"""The ``rocm`` platform on a CPU machine: device presence is simulated only at the probe's inputs.

The probe reads ``torch.version.hip``, a KFD device file, the KFD topology in
sysfs and the DRI render nodes; the tests point those at a fake tree and set
``torch.version.hip``. Everything above (the probe's logic, visibility
variables, plugin loading, selection, config adjustments, ``dovetail plugins``)
runs for real. No torch.cuda call is made; tests that could make one forbid it.
"""

from __future__ import annotations

import logging

import pytest
import torch

from dovetail import selection, testing
from dovetail.attention.backend import AttentionRequirements
from dovetail.cli import plugins_cmd
from dovetail.config import CacheConfig, EngineArgs
from dovetail.errors import ConfigError, SelectionError
from dovetail.plugin_manager import get_plugin_manager
from dovetail_rocm import kfd
from dovetail_rocm.kfd import KfdGpu
from dovetail.platform import kv_cache_budget
from dovetail_rocm.platform import RocmPlatform
from dovetail_rocm.probe import find_devices, probe
from dovetail_rocm.visible_devices import apply_hip_visible_devices, apply_rocr_visible_devices, visible_gpus
from test_rocm_fake_aiter import install_fake_aiter

MI300X = 90402
VISIBILITY_VARS = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


class FakeKfd:
    """A KFD sysfs tree, /dev/kfd and /dev/dri under a temporary directory."""

    def __init__(self, root, monkeypatch):
        self.nodes, self.dri, self.device = root / "nodes", root / "dri", root / "kfd"
        self.nodes.mkdir()
        self.dri.mkdir()
        monkeypatch.setattr(kfd, "KFD_DEVICE", str(self.device))
        monkeypatch.setattr(kfd, "KFD_TOPOLOGY_NODES", str(self.nodes))
        monkeypatch.setattr(kfd, "DRI_DIR", str(self.dri))
        self.device.write_text("")

    def add_cpu(self, node: int):
        self._node(node, 0, {"cpu_cores_count": 96, "simd_count": 0, "gfx_target_version": 0})

    def add_gpu(self, node: int, gfx=MI300X, unique_id=None, render=True, vram=192 << 30):
        minor = 128 + node
        self._node(node, 1000 + node, {"cpu_cores_count": 0, "simd_count": 1216, "gfx_target_version": gfx,
                                       "unique_id": unique_id if unique_id is not None else 0xA000 + node,
                                       "drm_render_minor": minor})
        bank = self.nodes / str(node) / "mem_banks" / "0"
        bank.mkdir(parents=True)
        bank.joinpath("properties").write_text(f"heap_type 1\nsize_in_bytes {vram}\nflags 0\n")
        if render:
            (self.dri / f"renderD{minor}").write_text("")

    def _node(self, node, gpu_id, props):
        d = self.nodes / str(node)
        d.mkdir()
        d.joinpath("gpu_id").write_text(f"{gpu_id}\n")
        d.joinpath("properties").write_text("".join(f"{k} {v}\n" for k, v in props.items()))


@pytest.fixture
def clean_env(monkeypatch):
    for var in (*VISIBILITY_VARS, "DOVETAIL_DEVICE", "DOVETAIL_ATTENTION_BACKEND", "DOVETAIL_ROCM_USE_AITER",
                "DOVETAIL_PLUGINS", "DOVETAIL_BLOCK_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(selection, "_logged", set())


@pytest.fixture
def machine(tmp_path, monkeypatch, clean_env):
    """An MI300X box: one CPU node and two GPUs, on a torch that says it is a ROCm build."""
    tree = FakeKfd(tmp_path, monkeypatch)
    tree.add_cpu(0)
    tree.add_gpu(1)
    tree.add_gpu(2)
    monkeypatch.setattr(torch.version, "hip", "6.4.43482-fake", raising=False)
    return tree


@pytest.fixture
def no_torch_cuda(monkeypatch):
    """Fail the test if anything calls the torch.cuda runtime (it would start HIP on a ROCm machine)."""
    def forbidden(*args, **kwargs):
        raise AssertionError("torch.cuda was called: the probe must not start the HIP runtime")

    for name in ("init", "_lazy_init", "device_count", "is_available", "mem_get_info", "get_device_properties"):
        monkeypatch.setattr(torch.cuda, name, forbidden)


# -- the probe -----------------------------------------------------------------------------------


def test_not_usable_on_a_torch_without_hip(tmp_path, monkeypatch, clean_env):
    FakeKfd(tmp_path, monkeypatch).add_gpu(1)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    result = probe()
    assert not result.usable and "torch.version.hip is not set" in result.reason


def test_not_usable_without_the_kfd_device(machine):
    machine.device.unlink()
    result = probe()
    assert not result.usable and "does not exist" in result.reason and "/dev/kfd" in result.reason


def test_probe_finds_the_gpus_without_touching_torch_cuda(machine, no_torch_cuda):
    result = probe()
    assert result.usable, result.reason
    assert result.reason == "2 visible GPU(s): 2 x gfx942; HIP 6.4.43482-fake"
    platform = RocmPlatform()
    assert platform.device_count() == 2
    assert [g.node for g in platform.devices.visible] == [1, 2]
    assert platform.devices.visible[0].vram_bytes == 192 << 30
    assert "2 visible GPU(s)" in platform.describe()


def test_gpu_whose_render_node_is_not_passed_in_is_skipped(machine):
    machine.add_gpu(3, render=False)
    devices = find_devices()
    assert [g.node for g in devices.present] == [1, 2]
    machine.add_cpu(4)
    for gpu in (1, 2):
        (machine.dri / f"renderD{128 + gpu}").unlink()
    result = probe()
    assert not result.usable and "renderD129 is not accessible" in result.reason


def test_nodes_are_enumerated_in_numeric_order(tmp_path, monkeypatch, clean_env):
    tree = FakeKfd(tmp_path, monkeypatch)
    monkeypatch.setattr(torch.version, "hip", "6.4", raising=False)
    for node in (10, 2, 0):
        tree.add_gpu(node) if node else tree.add_cpu(node)
    assert [g.node for g in find_devices().present] == [2, 10]


@pytest.mark.parametrize("version, arch", [(90402, "gfx942"), (90010, "gfx90a"), (90500, "gfx950"),
                                           (110001, "gfx1101"), (120001, "gfx1201")])
def test_gfx_target_version_names_the_llvm_target(version, arch):
    assert KfdGpu(0, 1, version, 0, 1, 128, 0).gfx_arch == arch


# -- visibility variables ----------------------------------------------------------------------------

# The four GPUs of the examples in ROCr's amd_filter_device.h.
ROCR_EXAMPLE_GPUS = [KfdGpu(i, i + 1, MI300X, uid, 1, 128 + i, 0) for i, uid in enumerate(
    (0xBABABABABABABABA, 0xABBAABBAABBAABBA, 0xBABAABBAABBABABA, 0xABBABABABABAABBA))]


@pytest.mark.parametrize("value, expected", [
    (None, [0, 1, 2, 3]),
    ("", []),                                 # A1: set but empty surfaces no GPU
    ("-1", []),                               # A2
    ("GPU-XX", []),                           # A3
    ("3,GPU-BABABABABABABABA,4", [3, 0]),      # B: 4 is out of range and ends the list
    ("3,GPU-BABAABBA,GPU-XX", [3, 2]),         # D: a unique UUID prefix selects
    ("gpu-babaabba", [2]),                    # tokens are upper-cased
    ("GPU-BABA", []),                         # ambiguous prefix ends the list
    ("1, 0x2 ,010", [1, 2]),                  # trimmed; strtol base 0: hex; 010 is octal 8, out of range
    ("2,2,1", [2]),                           # a repeated GPU ends the list
    ("0,1,2,3,", [0, 1, 2, 3]),
])
def test_rocr_visible_devices_follows_rocr(value, expected):
    assert [g.node for g in apply_rocr_visible_devices(ROCR_EXAMPLE_GPUS, value)] == expected


@pytest.mark.parametrize("value, expected", [
    (None, [0, 1, 2, 3]),
    ("", [0, 1, 2, 3]),                       # empty: no filtering (HIP, unlike ROCr)
    ("2,0", [2, 0]),
    ("2,0,2,1", [2, 0, 1]),                   # a repeat is skipped, not an end
    ("0,x,1", [0]),                           # an invalid token ends the list
    ("01", []),                               # must be the canonical decimal form
    ("1,", [1]),
    ("GPU-abbababa", [3]),                    # UUID substring, lower-case as HIP reports it
    ("GPU-ABBABABA", []),
])
def test_hip_visible_devices_follows_hip(value, expected):
    assert [g.node for g in apply_hip_visible_devices(ROCR_EXAMPLE_GPUS, value)] == expected


def test_hip_indexes_what_rocr_left_and_beats_cuda_visible_devices():
    env = {"ROCR_VISIBLE_DEVICES": "2,3", "HIP_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "0"}
    assert [g.node for g in visible_gpus(ROCR_EXAMPLE_GPUS, env)] == [3]
    assert [g.node for g in visible_gpus(ROCR_EXAMPLE_GPUS, {"CUDA_VISIBLE_DEVICES": "3,1"})] == [3, 1]
    assert [g.node for g in visible_gpus(ROCR_EXAMPLE_GPUS, {"HIP_VISIBLE_DEVICES": "", "CUDA_VISIBLE_DEVICES": "1"})] \
        == [1]


def test_visibility_sets_the_device_count_and_can_hide_everything(machine, monkeypatch):
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1")
    assert RocmPlatform().device_count() == 1
    assert "1 hidden by HIP_VISIBLE_DEVICES='1'" in probe().reason
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "")
    result = probe()
    assert not result.usable
    assert "2 AMD GPU(s) present but none visible with ROCR_VISIBLE_DEVICES=''" in result.reason


# -- selection -------------------------------------------------------------------------------------


def _requirements(platform, head_size=128, dtype=torch.bfloat16):
    return AttentionRequirements(platform="rocm", device_type=platform.device_type, dtype=dtype,
                                 kv_cache_dtype="auto", block_size=16, head_size=head_size, num_heads=32,
                                 num_kv_heads=8)


def test_rocm_is_chosen_over_the_cpu_and_dovetail_device_still_wins(machine):
    assert selection.resolve_platform_name() == "rocm"
    assert selection.resolve_platform_name("cpu") == "cpu"


def test_explicit_rocm_on_a_cpu_only_torch_says_why(machine, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.raises(SelectionError, match="device 'rocm' .* is not usable here: this torch is a"):
        selection.resolve_platform_name("rocm")


def test_without_aiter_the_platform_prefers_triton(machine):
    platform = selection.create_platform("rocm")
    assert platform.default_attention_backends() == ["TRITON", "REFERENCE"]
    candidates = selection.attention_backend_candidates(platform)
    assert candidates[0] == "TRITON" and candidates[-1] == "REFERENCE" and "ROCM_AITER" in candidates
    with pytest.raises(SelectionError, match="aiter package is not installed"):
        selection.select_attention_backend(platform, _requirements(platform), "ROCM_AITER")


def test_with_aiter_installed_rocm_aiter_is_chosen(machine, monkeypatch):
    install_fake_aiter(monkeypatch)
    platform = selection.create_platform("rocm")
    assert platform.default_attention_backends() == ["ROCM_AITER", "TRITON", "REFERENCE"]
    assert selection.select_attention_backend(platform, _requirements(platform)).name == "ROCM_AITER"


def test_unsupported_head_size_passes_over_aiter_with_the_reason(machine, monkeypatch, caplog):
    install_fake_aiter(monkeypatch)
    platform = selection.create_platform("rocm")
    with caplog.at_level(logging.INFO, logger="dovetail"):
        chosen = selection.select_attention_backend(platform, _requirements(platform, head_size=80))
    assert chosen.name != "ROCM_AITER"
    assert "passed over ROCM_AITER (head size 80 not supported by ROCM_AITER" in caplog.text
    with pytest.raises(SelectionError, match="head size 80 not supported by ROCM_AITER"):
        selection.select_attention_backend(platform, _requirements(platform, head_size=80), "ROCM_AITER")


def test_aiter_is_not_offered_on_a_gpu_its_decode_kernel_is_not_built_for(tmp_path, monkeypatch, clean_env):
    tree = FakeKfd(tmp_path, monkeypatch)
    tree.add_gpu(1, gfx=110000)  # Radeon PRO W7900 (RDNA3)
    install_fake_aiter(monkeypatch)
    platform = selection.create_platform("rocm")
    assert platform.default_attention_backends() == ["TRITON", "REFERENCE"]
    with pytest.raises(SelectionError, match="built for gfx90a, gfx942, gfx950 only .this machine has gfx1100."):
        selection.select_attention_backend(platform, _requirements(platform), "ROCM_AITER")


def test_switching_aiter_off(machine, monkeypatch):
    install_fake_aiter(monkeypatch)
    monkeypatch.setenv("DOVETAIL_ROCM_USE_AITER", "0")
    platform = selection.create_platform("rocm")
    assert platform.default_attention_backends() == ["TRITON", "REFERENCE"]
    with pytest.raises(SelectionError, match="switched off by DOVETAIL_ROCM_USE_AITER"):
        selection.select_attention_backend(platform, _requirements(platform), "ROCM_AITER")
    monkeypatch.setenv("DOVETAIL_ROCM_USE_AITER", "maybe")
    with pytest.raises(ConfigError, match="DOVETAIL_ROCM_USE_AITER='maybe'"):
        platform.default_attention_backends()


# -- config adjustments ------------------------------------------------------------------------------


def _config(**kwargs):
    return EngineArgs("some-model", **kwargs).create_engine_config()


def test_block_size_the_user_chose_that_aiter_cannot_use_is_an_error(machine, monkeypatch):
    install_fake_aiter(monkeypatch)
    config = _config(block_size=64, attention_backend="ROCM_AITER")
    with pytest.raises(ConfigError, match="block_size: 64 is not supported by attention backend ROCM_AITER"):
        RocmPlatform().check_and_update_config(config)
    config = _config(block_size=32, attention_backend="ROCM_AITER")
    RocmPlatform().check_and_update_config(config)
    assert config.cache.block_size == 32


def test_default_block_size_is_fitted_to_aiter_only_when_aiter_will_run(machine, monkeypatch):
    def config_with_unset_block_size(size):
        config = _config()
        fields = {**config.cache.model_dump(), "block_size": size}
        config.cache = CacheConfig.model_construct(_fields_set=set(), **fields)
        return config

    install_fake_aiter(monkeypatch)
    config = config_with_unset_block_size(8)
    RocmPlatform().check_and_update_config(config)
    assert config.cache.block_size == 16
    monkeypatch.setenv("DOVETAIL_ROCM_USE_AITER", "off")
    config = config_with_unset_block_size(8)
    RocmPlatform().check_and_update_config(config)
    assert config.cache.block_size == 8
    config = _config(block_size=64)  # chosen by the user, auto backend: AITER is passed over later, with its reason
    RocmPlatform().check_and_update_config(config)
    assert config.cache.block_size == 64


def test_auto_dtype_runs_float32_checkpoints_in_bfloat16(machine):
    platform = RocmPlatform()
    assert platform.resolve_dtype(torch.float32) == torch.bfloat16
    assert platform.resolve_dtype(torch.float16) == torch.float16
    assert platform.supported_dtypes()[0] == torch.bfloat16


def test_fused_ops_are_the_cores_triton_ops_when_triton_imports(machine, monkeypatch):
    import dovetail.triton

    if dovetail.triton.triton_missing_reason() is None:
        assert RocmPlatform().fused_ops().name == "triton"
    monkeypatch.setattr(dovetail.triton, "triton_missing_reason", lambda: "triton cannot be imported")
    assert RocmPlatform().fused_ops().name == "torch"


def test_kv_cache_budget_leaves_out_memory_held_outside_torch_and_the_graph_reserve():
    gib = 2**30
    # 192 GiB device, 20 GiB free, torch holds 160 GiB: 12 GiB are held outside torch (HIP context, RCCL, others)
    assert kv_cache_budget(192 * gib, 20 * gib, 160 * gib, 30 * gib, 0.9, RocmPlatform.graph_memory_reserve) == \
        int(192 * gib * 0.9) - 30 * gib - 12 * gib - RocmPlatform.graph_memory_reserve
    assert kv_cache_budget(192 * gib, 192 * gib, 0, 30 * gib, 0.5, 0) == 66 * gib
    with pytest.raises(ConfigError, match="gpu_memory_utilization: 0.1 leaves no memory for the KV cache"):
        kv_cache_budget(192 * gib, 100 * gib, 10 * gib, 30 * gib, 0.1, 0)


def test_platform_declarations():
    assert (RocmPlatform.name, RocmPlatform.device_type, RocmPlatform.dist_backend) == ("rocm", "cuda", "nccl")
    assert RocmPlatform.is_accelerator and RocmPlatform.supports_graph_capture
    assert "NOT verified on hardware" in RocmPlatform.verification


# -- dovetail plugins ----------------------------------------------------------------------------------


def test_dovetail_plugins_shows_rocm_usable_and_unverified(machine, monkeypatch):
    install_fake_aiter(monkeypatch)
    data = plugins_cmd.collect()
    rocm = data["platforms"]["rocm"]
    assert rocm["usable"] and rocm["plugin"] == "rocm" and rocm["priority"] == 100
    assert "NOT verified on hardware" in rocm["verification"]
    aiter = data["attention_backends"]["ROCM_AITER"]
    assert aiter["usable"] and "real aiter was never executed" in aiter["verification"]
    assert aiter["capabilities"]["head_sizes"] == [64, 128, 256]
    assert data["auto_selection"]["device"] == "rocm"
    assert data["auto_selection"]["attention_backend"] == "ROCM_AITER"
    text = plugins_cmd.render(data)
    assert "rocm       usable: yes -- 2 visible GPU(s): 2 x gfx942" in text
    assert "NOT verified on hardware: no AMD GPU was available" in text


def test_dovetail_plugins_here_says_why_rocm_is_not_usable(clean_env):
    data = plugins_cmd.collect()
    assert data["platforms"]["rocm"]["usable"] is False
    assert "torch.version.hip is not set" in data["platforms"]["rocm"]["reason"]
    assert "ROCM_AITER" in data["attention_backends"]
    assert get_plugin_manager().plugins["rocm"].loaded


# -- the conformance kit's CPU-runnable checks ---------------------------------------------------------------


def test_kit_platform_check_on_this_machine(clean_env):
    assert testing.check_platform(RocmPlatform) is None  # not usable here, with a reason


def test_kit_import_is_cheap():
    testing.check_import_is_cheap("dovetail_rocm.plugin", "dovetail_rocm.platform", "dovetail_rocm.probe",
                                  "dovetail_rocm.aiter_backend")
