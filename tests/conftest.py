"""Shared fixtures: tiny HF models on disk, built once per session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# DOVETAIL_CPU_ISA=avx2|portable runs the suite as on a CPU whose best path that is (the CPU plugin hides
# the faster ones); torch's own kernels are capped to match, before torch is imported.
_TORCH_CPU_CAPABILITY = {"avx512_bf16": ("avx512", "AVX512_CORE_BF16"), "avx512": ("avx512", "AVX512_CORE"),
                         "avx2": ("avx2", "AVX2"), "portable": ("default", "SSE41")}
if os.environ.get("DOVETAIL_CPU_ISA", "").strip().lower() in _TORCH_CPU_CAPABILITY:
    _aten, _onednn = _TORCH_CPU_CAPABILITY[os.environ["DOVETAIL_CPU_ISA"].strip().lower()]
    os.environ.setdefault("ATEN_CPU_CAPABILITY", _aten)
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", _onednn)

import tiny_models  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A 2-layer GQA Llama (float32) with a local BPE tokenizer."""
    return tiny_models.save_model(tmp_path_factory.mktemp("tiny-llama"), tiny_models.tiny_llama_config())


@pytest.fixture(scope="session")
def tiny_llama_hf(tiny_llama_dir):
    return tiny_models.load_hf(tiny_llama_dir)


@pytest.fixture(autouse=True)
def _fresh_plugin_manager():
    """Each test sees plugins loaded under its own environment."""
    from dovetail.plugin_manager import reset_plugin_manager

    reset_plugin_manager()
    yield
    reset_plugin_manager()


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def tp_ranks():
    """``tp_ranks(world)``: a group of ``world`` rank processes over gloo (see tests/spmd.py), shared by the
    module's tests, replaced after a failure and stopped after the module (no process outlives it)."""
    from spmd import SpmdRanks

    groups: dict[int, SpmdRanks] = {}

    def get(world: int) -> SpmdRanks:
        group = groups.get(world)
        if group is None or group.broken:
            group = groups[world] = SpmdRanks(world)
        return group

    yield get
    for group in groups.values():
        group.close()


@pytest.fixture(scope="module")
def client(server):
    """The official ``openai`` client on the requesting module's ``server`` fixture (a ``ServerProcess``)."""
    import openai
    from test_server_cli import API_KEY

    with openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c
