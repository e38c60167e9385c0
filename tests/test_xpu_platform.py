"""The ``xpu`` platform on a CPU machine: device presence is simulated only at the probe's inputs.

The probe reads ``torch._C._has_xpu``, ``/sys/class/drm/renderD*`` and
``/dev/dri``, and ``ZE_AFFINITY_MASK`` / ``ZE_FLAT_DEVICE_HIERARCHY``; the tests
point those at a fake tree and set the flag. Everything above (the probe's
logic, plugin loading, selection, config adjustments, ``dovetail plugins``)
runs for real. No torch.xpu call is made; tests that could make one forbid it.
"""

from __future__ import annotations

import os

import pytest
import torch

from dovetail import selection, testing
from dovetail.attention.backend import AttentionRequirements
from dovetail.cli import plugins_cmd
from dovetail.config import EngineArgs
from dovetail.errors import ConfigError, PluginError, SelectionError
from dovetail_xpu import probe as xpu_probe
from dovetail.platform import kv_cache_budget
from dovetail_xpu.platform import XpuPlatform
from dovetail_xpu.probe import IntelGpu, apply_affinity_mask, find_devices, probe

ARC_A770, ARC_B580, MI300X_PCI = 0x56A0, 0xE20B, 0x74A1


class FakeDrm:
    """``/sys/class/drm`` and ``/dev/dri`` under a temporary directory."""

    def __init__(self, root, monkeypatch):
        self.root, self.drm, self.dri = root, root / "drm", root / "dri"
        for d in (self.drm, self.dri, root / "pci", root / "drivers"):
            d.mkdir()
        monkeypatch.setattr(xpu_probe, "DRM_SYSFS", str(self.drm))
        monkeypatch.setattr(xpu_probe, "DRI_DIR", str(self.dri))

    def add(self, minor: int, pci: str, vendor: int = 0x8086, device: int = ARC_A770, driver: str = "xe",
            accessible: bool = True):
        pci_dir = self.root / "pci" / pci
        pci_dir.mkdir()
        pci_dir.joinpath("vendor").write_text(f"0x{vendor:04x}\n")
        pci_dir.joinpath("device").write_text(f"0x{device:04x}\n")
        driver_dir = self.root / "drivers" / driver
        driver_dir.mkdir(exist_ok=True)
        os.symlink(driver_dir, pci_dir / "driver")
        (self.drm / f"renderD{minor}").mkdir()
        os.symlink(pci_dir, self.drm / f"renderD{minor}" / "device")
        if accessible:
            (self.dri / f"renderD{minor}").write_text("")


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("ZE_AFFINITY_MASK", "ZE_FLAT_DEVICE_HIERARCHY", "DOVETAIL_DEVICE", "DOVETAIL_ATTENTION_BACKEND",
                "DOVETAIL_PLUGINS", "DOVETAIL_BLOCK_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(selection, "_logged", set())


@pytest.fixture
def machine(tmp_path, monkeypatch, clean_env):
    """Two Intel Arc GPUs (one on i915, one on xe) and an AMD GPU, on a torch built with XPU."""
    tree = FakeDrm(tmp_path, monkeypatch)
    tree.add(129, "0000:03:00.0", device=ARC_A770, driver="i915")
    tree.add(128, "0000:83:00.0", device=ARC_B580, driver="xe")
    tree.add(130, "0000:04:00.0", vendor=0x1002, device=MI300X_PCI, driver="amdgpu")
    monkeypatch.setattr(torch._C, "_has_xpu", True)
    return tree


@pytest.fixture
def no_torch_xpu(monkeypatch):
    """Fail the test if anything calls into the torch.xpu runtime."""
    def forbidden(*args, **kwargs):
        raise AssertionError("torch.xpu was called: the probe must not start the SYCL/Level Zero runtime")

    for name in ("init", "_lazy_init", "device_count", "is_available", "mem_get_info", "get_device_properties"):
        monkeypatch.setattr(torch.xpu, name, forbidden)


# -- the probe -----------------------------------------------------------------------------------


def test_not_usable_on_a_torch_built_without_xpu(tmp_path, monkeypatch, clean_env):
    FakeDrm(tmp_path, monkeypatch).add(128, "0000:03:00.0")
    monkeypatch.setattr(torch._C, "_has_xpu", False)
    result = probe()
    assert not result.usable and "torch._C._has_xpu is False" in result.reason


def test_probe_finds_intel_gpus_in_pci_order_without_touching_torch_xpu(machine, no_torch_xpu):
    result = probe()
    assert result.usable, result.reason
    devices = find_devices()
    assert [g.pci_address for g in devices.visible] == ["0000:03:00.0", "0000:83:00.0"]
    assert [(g.render_node, g.device_id, g.driver) for g in devices.visible] == \
        [("renderD129", ARC_A770, "i915"), ("renderD128", ARC_B580, "xe")]
    assert XpuPlatform().device_count() == 2
    assert result.reason.startswith("2 visible Intel GPU(s): renderD129 (device 0x56a0, i915)")


def test_inaccessible_or_foreign_nodes_are_skipped(tmp_path, monkeypatch, clean_env):
    tree = FakeDrm(tmp_path, monkeypatch)
    monkeypatch.setattr(torch._C, "_has_xpu", True)
    tree.add(128, "0000:03:00.0", accessible=False)
    tree.add(129, "0000:04:00.0", driver="vfio-pci")
    tree.add(130, "0000:05:00.0", vendor=0x10DE)
    result = probe()
    assert not result.usable and "no Intel GPU found" in result.reason
    tree.add(131, "0000:06:00.0")
    assert [g.render_node for g in find_devices().visible] == ["renderD131"]


# -- ZE_AFFINITY_MASK ------------------------------------------------------------------------------------

GPUS = [IntelGpu(f"renderD{128 + i}", f"0000:0{i}:00.0", ARC_A770, "xe") for i in range(3)]


@pytest.mark.parametrize("mask, hierarchy, expected", [
    (None, None, [0, 1, 2]),
    ("", None, [0, 1, 2]),
    ("default", None, [0, 1, 2]),
    ("2,0", None, [0, 2]),           # visible devices keep their enumeration order
    ("1,1", None, [1]),
    ("7,1", None, [1]),              # past the last device: ignored
    ("0x2", None, [2]),              # std::stoul base 0
    (" 1", None, [1]),
    ("1abc", None, [1]),             # stoul reads the leading number
    ("abc,2", None, [2]),            # no leading number: ignored here (the runtime raises)
    ("0.0,1", "FLAT", [1]),          # FLAT (the default): indices count tiles, N.M entries are ignored
    ("0.0,1", None, [1]),
    ("0.0,2", "COMBINED", [2]),
    ("0.0,2", "COMPOSITE", [0, 2]),  # COMPOSITE: N.M is tile M of card N
    ("0.1", "COMPOSITE", []),        # these GPUs have one tile
])
def test_affinity_mask_follows_the_compute_runtime(mask, hierarchy, expected):
    assert [GPUS.index(g) for g in apply_affinity_mask(GPUS, mask, hierarchy)] == expected


def test_affinity_mask_sets_the_device_count(machine, monkeypatch):
    monkeypatch.setenv("ZE_AFFINITY_MASK", "1")
    assert XpuPlatform().device_count() == 1
    assert "1 hidden by ZE_AFFINITY_MASK='1'" in probe().reason
    monkeypatch.setenv("ZE_AFFINITY_MASK", "0.0")
    result = probe()
    assert not result.usable and "none visible with ZE_AFFINITY_MASK='0.0'" in result.reason
    monkeypatch.setenv("ZE_FLAT_DEVICE_HIERARCHY", "COMPOSITE")
    assert probe().usable


# -- selection and config ----------------------------------------------------------------------------------


def test_xpu_is_chosen_over_the_cpu(machine):
    assert selection.resolve_platform_name() == "xpu"
    assert selection.resolve_platform_name("cpu") == "cpu"


def test_attention_goes_to_triton_then_reference(machine):
    platform = selection.create_platform("xpu")
    assert platform.default_attention_backends() == ["TRITON", "REFERENCE"]
    candidates = selection.attention_backend_candidates(platform)
    assert candidates == ["TRITON", "REFERENCE"], "no other backend serves xpu"
    req = AttentionRequirements(platform="xpu", device_type="xpu", dtype=torch.bfloat16, kv_cache_dtype="auto",
                                block_size=16, head_size=128, num_heads=32, num_kv_heads=8)
    registry = selection.get_plugin_manager().registry
    try:
        triton_fits = registry.attention_backends["TRITON"].load().validate(req) == []
    except PluginError:
        triton_fits = False
    chosen = selection.select_attention_backend(platform, req)
    assert chosen.name == ("TRITON" if triton_fits else "REFERENCE")
    with pytest.raises(SelectionError, match="does not run on device 'xpu'"):
        selection.select_attention_backend(platform, req, "ROCM_AITER")


def test_config_runs_eagerly_and_auto_dtype_is_bfloat16(machine):
    config = EngineArgs("some-model").create_engine_config()
    platform = XpuPlatform()
    platform.check_and_update_config(config)
    assert config.device.enforce_eager is True
    assert platform.resolve_dtype(torch.float32) == torch.bfloat16
    assert platform.resolve_dtype(torch.float16) == torch.float16


def test_fused_ops_are_the_cores_triton_ops_when_triton_imports(machine, monkeypatch):
    import dovetail.triton

    if dovetail.triton.triton_missing_reason() is None:
        assert XpuPlatform().fused_ops().name == "triton"
    monkeypatch.setattr(dovetail.triton, "triton_missing_reason", lambda: "triton cannot be imported")
    assert XpuPlatform().fused_ops().name == "torch"


def test_kv_cache_budget_leaves_out_memory_held_outside_torch():
    gib = 2**30
    # 64 GiB device, 10 GiB free, torch holds 50 GiB: 4 GiB are held outside torch
    assert kv_cache_budget(64 * gib, 10 * gib, 50 * gib, 6 * gib, 0.9) == int(64 * gib * 0.9) - 6 * gib - 4 * gib
    with pytest.raises(ConfigError, match="gpu_memory_utilization: 0.1 leaves no memory for the KV cache"):
        kv_cache_budget(64 * gib, 60 * gib, 0, 8 * gib, 0.1)


def test_platform_declarations():
    assert (XpuPlatform.name, XpuPlatform.device_type, XpuPlatform.dist_backend) == ("xpu", "xpu", "xccl")
    assert not XpuPlatform.supports_graph_capture and "NOT verified on hardware" in XpuPlatform.verification


def test_rocm_and_xpu_both_usable_is_an_error_naming_the_flag(machine, tmp_path, monkeypatch):
    from test_rocm_platform import FakeKfd

    for var in ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "amd").mkdir()
    FakeKfd(tmp_path / "amd", monkeypatch).add_gpu(1)
    monkeypatch.setattr(torch.version, "hip", "6.4", raising=False)
    with pytest.raises(SelectionError, match="'rocm', 'xpu'|'xpu', 'rocm'") as err:
        selection.resolve_platform_name()
    assert "--device" in str(err.value)


# -- dovetail plugins and the kit ----------------------------------------------------------------------------


def test_dovetail_plugins_shows_xpu_usable_and_unverified(machine):
    data = plugins_cmd.collect()
    xpu = data["platforms"]["xpu"]
    assert xpu["usable"] and xpu["priority"] == 100 and "NOT verified on hardware" in xpu["verification"]
    assert data["auto_selection"]["device"] == "xpu"
    assert data["auto_selection"]["attention_backends_in_order"] == ["TRITON", "REFERENCE"]
    text = plugins_cmd.render(data)
    assert "xpu        usable: yes -- 2 visible Intel GPU(s)" in text
    assert "NOT verified on hardware: no Intel GPU was available" in text


def test_dovetail_plugins_here_says_why_xpu_is_not_usable(clean_env):
    entry = plugins_cmd.collect()["platforms"]["xpu"]
    assert entry["usable"] is False and "without XPU support" in entry["reason"]


def test_kit_platform_check_on_this_machine(clean_env):
    assert testing.check_platform(XpuPlatform) is None


def test_kit_import_is_cheap():
    testing.check_import_is_cheap("dovetail_xpu.plugin", "dovetail_xpu.platform", "dovetail_xpu.probe")
