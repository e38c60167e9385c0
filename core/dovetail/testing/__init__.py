"""The conformance kit: check a plugin against the Dovetail contract with pytest.

A vendor's test file can be as short as::

    import pytest
    from dovetail import testing

    @pytest.mark.parametrize("case", testing.attention_cases(), ids=str)
    def test_attention(case):
        testing.check_attention_case(MyBackend, case, device="cpu")

    def test_platform():
        testing.check_platform(MyPlatform)

    def test_import_touches_no_device():
        testing.check_import_is_cheap("my_plugin.plugin")

Each check raises ``AssertionError`` with a message saying what differs, or
``pytest.skip``-able :class:`NotApplicable` when the backend declares it does not
support a case.
"""

from dovetail.testing.attention import (AttentionCase, NotApplicable, attention_cases, check_attention_case,
                                        row_positions)
from dovetail.testing.host_sync import HostSyncError, forbid_host_sync
from dovetail.testing.imports import check_import_is_cheap
from dovetail.testing.platform import check_fused_ops, check_platform
from dovetail.testing.quant import check_quant_roundtrip

__all__ = [
    "AttentionCase", "NotApplicable", "attention_cases", "check_attention_case", "check_platform",
    "check_fused_ops", "check_quant_roundtrip", "check_import_is_cheap", "row_positions", "forbid_host_sync",
    "HostSyncError",
]
