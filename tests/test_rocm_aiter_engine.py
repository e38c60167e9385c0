"""The whole engine through ROCM_AITER's marshalling, on CPU, with a FAKE aiter (real aiter never runs).

A throwaway plugin registers the real ROCM_AITER backend under another name for
the ``cpu`` platform (only its device-type declaration is relaxed). The engine's
own batches then reach the fake aiter: decodes, chunked prefills whose context is
gathered from the paged cache, and mixed steps. Greedy tokens and logprobs must
match the same engine on REFERENCE.
"""

from __future__ import annotations

import pytest
import torch

import tiny_models
from dovetail import LLM, SamplingParams
from dovetail.plugin_manager import reset_plugin_manager
from fake_plugins import install_fake_plugin
from test_rocm_fake_aiter import install_fake_aiter

PLUGIN_SOURCE = '''
from dovetail.hookspecs import hookimpl
from dovetail_rocm.aiter_backend import RocmAiterBackend

DOVETAIL_PLUGIN_API = ">=1.0,<2"


class AiterOnCpu(RocmAiterBackend):
    """ROCM_AITER, accepting CPU tensors."""

    name = "AITER_ON_CPU"
    supported_device_types = None


@hookimpl
def register_attention_backends(register):
    register(name="AITER_ON_CPU", cls="rocm_aiter_on_cpu:AiterOnCpu", platforms=("cpu",))
'''

PROMPTS = [list(range(20, 61)), [5, 6, 7], list(range(100, 119))]


@pytest.fixture(scope="module")
def head64_llama_dir(tmp_path_factory):
    """A 2-layer GQA Llama whose head size (64) AITER supports."""
    config = tiny_models.tiny_llama_config(hidden_size=128, intermediate_size=128, num_attention_heads=2,
                                           num_key_value_heads=1)
    return tiny_models.save_model(tmp_path_factory.mktemp("llama-h64"), config)


def _generate(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


def test_engine_through_fake_aiter_matches_reference(head64_llama_dir, tmp_path, monkeypatch):
    from dovetail_cpu import cpu_info

    if not cpu_info.has_bf16():
        pytest.skip("ROCM_AITER computes in 16 bits; this CPU platform offers float32 only")
    fake = install_fake_aiter(monkeypatch)
    install_fake_plugin(tmp_path / "plugin", monkeypatch, "rocm_aiter_on_cpu", "rocm_aiter_on_cpu", PLUGIN_SOURCE)
    reset_plugin_manager()
    common = dict(dtype="bfloat16", block_size=16, max_num_batched_tokens=24, device="cpu")
    want = _generate(LLM(str(head64_llama_dir), attention_backend="REFERENCE", **common))
    llm = LLM(str(head64_llama_dir), attention_backend="AITER_ON_CPU", **common)
    got = _generate(llm)
    called = {name for name, _ in fake.calls}
    assert called == {"paged_attention_v1", "flash_attn_varlen_func"}
    assert any(kw["cu_seqlens_k"][-1] > kw["cu_seqlens_q"][-1] for name, kw in fake.calls
               if name == "flash_attn_varlen_func"), "a chunked prefill should have gathered cached context"
    for ours, ref in zip(got, want):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
        for step, token in enumerate(ref.outputs[0].token_ids):
            assert abs(ours.outputs[0].logprobs[step][token].logprob
                       - ref.outputs[0].logprobs[step][token].logprob) < 0.05
    assert torch.version.hip  # the fake's ROCm torch stayed in place throughout
