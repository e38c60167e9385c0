"""Every invalid SamplingParams field, engine argument and request is rejected, naming the field."""

from __future__ import annotations

import pytest

from dovetail import LLM, SamplingParams
from dovetail.config import EngineArgs
from dovetail.errors import ConfigError, ModelLoadError, RequestError

INVALID_SAMPLING = [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0),
    ("logit_bias", {5: 101.0}), ("logit_bias", {-1: 1.0}), ("stop", [""]), ("stop_token_ids", [-3]),
    ("max_tokens", 0), ("min_tokens", -1), ("logprobs", -1), ("prompt_logprobs", -2), ("seed", 2**70),
    ("temperature", "hot"), ("ignore_eos", "maybe"),
]


@pytest.mark.parametrize("field,value", INVALID_SAMPLING, ids=lambda v: str(v))
def test_invalid_sampling_field_is_named(field, value):
    with pytest.raises(RequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field
    assert f"{field}:" in str(info.value)


def test_unknown_sampling_field_is_named():
    with pytest.raises(RequestError, match="top_kk"):
        SamplingParams(top_kk=3)


def test_min_tokens_above_max_tokens():
    with pytest.raises(RequestError, match=r"min_tokens: must be <= max_tokens \(2\) \(got 5\)") as info:
        SamplingParams(min_tokens=5, max_tokens=2)
    assert info.value.field == "min_tokens"


def test_assignment_is_validated_too():
    params = SamplingParams()
    with pytest.raises(RequestError, match="temperature"):
        params.temperature = -1


INVALID_ENGINE = [
    ("block_size", 0), ("block_size", 24), ("gpu_memory_utilization", 1.5), ("gpu_memory_utilization", 0),
    ("max_num_seqs", 0), ("max_num_batched_tokens", 0), ("max_model_len", -4), ("dtype", "float8"),
    ("kv_cache_dtype", "int4"), ("kv_cache_memory_bytes", 0), ("seed", -1), ("load_format", "pt"),
    ("scheduling_policy", "lifo"), ("tensor_parallel_size", 0), ("cpu_threads", 0),
]


@pytest.mark.parametrize("field,value", INVALID_ENGINE, ids=lambda v: str(v))
def test_invalid_engine_argument_is_named_when_the_config_is_built(field, value):
    with pytest.raises(ConfigError) as info:
        EngineArgs("/nonexistent", **{field: value}).create_engine_config()
    assert f"{field}:" in str(info.value)


def test_defaults_follow_vllm():
    config = EngineArgs("/m").create_engine_config()
    assert config.cache.block_size == 16 and config.cache.gpu_memory_utilization == 0.9
    assert config.cache.enable_prefix_caching and config.scheduler.enable_chunked_prefill
    assert config.model.dtype == "auto" and config.cache.kv_cache_dtype == "auto"
    assert config.model.max_model_len is None and not config.device.enforce_eager


def test_batch_limits_come_from_the_platform_unless_set(tiny_llama_dir, monkeypatch):
    from dovetail_cpu.platform import CpuPlatform

    llm = LLM(str(tiny_llama_dir), attention_backend="REFERENCE", max_model_len=64)
    sched = llm.llm_engine.config.scheduler
    assert (sched.max_num_batched_tokens, sched.max_num_seqs) == (8192, 256)  # vLLM's, for devices under 70 GiB
    asked = []

    def large_device(self, usage):
        asked.append(usage)
        return (16384 if usage == "llm" else 8192), 1024

    monkeypatch.setattr(CpuPlatform, "default_batch_limits", large_device)
    sched = LLM(str(tiny_llama_dir), attention_backend="REFERENCE", max_model_len=64).llm_engine.config.scheduler
    assert (sched.max_num_batched_tokens, sched.max_num_seqs) == (16384, 1024) and asked == ["llm"]
    sched = LLM(str(tiny_llama_dir), attention_backend="REFERENCE", max_model_len=64, max_num_seqs=8,
                max_num_batched_tokens=512).llm_engine.config.scheduler
    assert (sched.max_num_batched_tokens, sched.max_num_seqs) == (512, 8)


def test_missing_path_and_hub_ids_are_clear(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache; Dovetail does not download"):
        LLM("some-org/some-model-that-is-not-cached")
    with pytest.raises(ModelLoadError, match="has no config.json"):
        LLM(str(tmp_path))


def test_max_model_len_beyond_the_model_is_refused(tiny_llama_dir):
    with pytest.raises(ConfigError, match=r"max_model_len: 100000 exceeds the model's maximum of 512"):
        LLM(str(tiny_llama_dir), max_model_len=100000)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), attention_backend="REFERENCE", max_model_len=64)


def test_request_that_can_never_fit_is_rejected_up_front(llm):
    with pytest.raises(RequestError, match=r"max_tokens: the prompt \(10 tokens\) plus max_tokens \(60\) exceeds "
                                           r"max_model_len \(64\)"):
        llm.generate([{"prompt_token_ids": list(range(10))}], SamplingParams(max_tokens=60), use_tqdm=False)
    with pytest.raises(RequestError, match=r"prompt: the prompt has 70 tokens, but max_model_len is 64"):
        llm.generate([{"prompt_token_ids": list(range(70))}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("ids", [[-1, 3], [3, 320], [True], []])
def test_bad_prompt_token_ids(llm, ids):
    with pytest.raises(RequestError) as info:
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert info.value.field in ("prompt_token_ids", "prompt")


def test_out_of_vocabulary_ids_in_sampling_params(llm):
    with pytest.raises(RequestError, match=r"logit_bias: token id 999 is out of the vocabulary \(size 320\)"):
        llm.generate(["hi"], SamplingParams(logit_bias={999: 1.0}), use_tqdm=False)
    with pytest.raises(RequestError, match=r"stop_token_ids: token id 5000"):
        llm.generate(["hi"], SamplingParams(stop_token_ids=[5000]), use_tqdm=False)
    with pytest.raises(RequestError, match=r"logprobs: 21 exceeds the maximum of 20"):
        llm.generate(["hi"], SamplingParams(logprobs=21), use_tqdm=False)


def test_a_bad_request_in_a_batch_loses_no_other_work(llm):
    with pytest.raises(RequestError):
        llm.generate([{"prompt_token_ids": [4, 5]}, {"prompt_token_ids": [-7]}], SamplingParams(max_tokens=2),
                     use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate([{"prompt_token_ids": [4, 5]}], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_abort_frees_blocks_at_once(llm):
    engine = llm.llm_engine
    engine.add_request("to-abort", {"prompt_token_ids": list(range(40))}, SamplingParams(max_tokens=10))
    engine.step()
    assert engine.kv_manager.pool.num_free < engine.num_blocks
    engine.abort_request("to-abort")
    assert engine.kv_manager.pool.num_free == engine.num_blocks
    assert not engine.has_unfinished_requests()


def test_priorities_run_the_most_urgent_first(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), attention_backend="REFERENCE", max_model_len=64, max_num_seqs=1,
              scheduling_policy="priority")
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0)
    engine.add_request("low", {"prompt_token_ids": [3, 4]}, params, priority=5)
    engine.add_request("high", {"prompt_token_ids": [3, 4]}, params, priority=-1)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["high", "low"]
    with pytest.raises(RequestError, match="priority"):
        LLM(str(tiny_llama_dir), attention_backend="REFERENCE", max_model_len=64).llm_engine.add_request(
            "x", [3], params, priority=2)
