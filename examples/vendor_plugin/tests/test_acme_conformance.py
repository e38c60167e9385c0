"""Acme's own CI: Dovetail's conformance kit run against the plugin's implementations."""

import pytest

from dovetail import testing
from acme_dovetail.attention import ToyAttentionBackend
from acme_dovetail.platform import ToyPlatform
from acme_dovetail.quant import ToyInt8Method, quantize_int8


@pytest.mark.parametrize("case", testing.attention_cases(), ids=str)
def test_attention_matches_reference(case):
    try:
        testing.check_attention_case(ToyAttentionBackend, case, platform="toy")
    except testing.NotApplicable as why:
        assert case.sliding_window or case.logit_softcap, f"only declared limits may skip: {why}"
        pytest.skip(str(why))


def test_platform_contract():
    assert testing.check_platform(ToyPlatform) is not None


def test_quantization_round_trip():
    testing.check_quant_roundtrip(ToyInt8Method(), quantize_int8, rel_tol=0.02)


def test_importing_the_plugin_touches_no_device():
    testing.check_import_is_cheap("acme_dovetail.plugin")
