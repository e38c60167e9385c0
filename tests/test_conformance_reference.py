"""The conformance kit run on the core's REFERENCE backend and the CPU platform, and shown able to fail."""

from __future__ import annotations

import pytest
import torch

from dovetail import testing
from dovetail.attention.reference import ReferenceAttentionImpl, ReferenceBackend


@pytest.mark.parametrize("case", testing.attention_cases(), ids=str)
def test_reference_passes_its_own_kit(case):
    testing.check_attention_case(ReferenceBackend, case)


def test_reference_in_bfloat16():
    testing.check_attention_case(ReferenceBackend, testing.attention_cases()[3], dtype=torch.bfloat16)


class _OffByOneBackend(ReferenceBackend):
    """A deliberately wrong backend: it forgets the causal rule by shifting the softmax scale."""

    name = "BROKEN"

    @classmethod
    def impl_cls(cls):
        class Impl(ReferenceAttentionImpl):
            def forward(self, q, k, v, kv_cache, metadata):
                return super().forward(q * 1.01, k, v, kv_cache, metadata)

        return Impl


class _NoSoftcapBackend(ReferenceBackend):
    name = "NO_SOFTCAP"
    supports_logit_softcap = False


def test_kit_catches_a_wrong_backend():
    with pytest.raises(AssertionError, match="differs from REFERENCE"):
        testing.check_attention_case(_OffByOneBackend, testing.attention_cases()[0])


def test_kit_skips_what_the_backend_declares_unsupported():
    softcap_case = next(c for c in testing.attention_cases() if c.logit_softcap)
    with pytest.raises(testing.NotApplicable, match="soft-capping"):
        testing.check_attention_case(_NoSoftcapBackend, softcap_case)


def test_cpu_platform_contract_and_fused_ops():
    from dovetail_cpu.platform import CpuPlatform

    assert testing.check_platform(CpuPlatform) is not None


def test_platform_check_catches_a_visible_devices_variable_that_is_no_name():
    from dovetail_cpu.platform import CpuPlatform

    class Spaced(CpuPlatform):
        visible_devices_env = "CUDA VISIBLE DEVICES"

    with pytest.raises(AssertionError, match="visible_devices_env"):
        testing.check_platform(Spaced)


def test_fused_ops_check_catches_a_wrong_op():
    from dovetail.ops import FusedOps

    class WrongOps(FusedOps):
        def silu_and_mul(self, x):
            return super().silu_and_mul(x) * 1.001

    with pytest.raises(AssertionError, match="silu_and_mul"):
        testing.check_fused_ops(WrongOps())


def test_unquantized_roundtrip():
    from dovetail.quantization.unquantized import UnquantizedMethod

    error = testing.check_quant_roundtrip(UnquantizedMethod(), lambda w: {"weight": w}, rel_tol=1e-5)
    assert error < 1e-5


def test_import_of_core_and_plugins_touches_no_device():
    testing.check_import_is_cheap("dovetail", "dovetail.builtin_plugin", "dovetail_cpu.plugin",
                                  "dovetail_models.plugin")
