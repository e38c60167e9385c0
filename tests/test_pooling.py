"""Embedding models (``runner="pooling"``): ``LLM.embed`` against HF transformers' hidden states on the same
weights, for each pooling type, over chunked prompts, at one rank and two."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModel, Qwen3Config, Qwen3Model

import tiny_models
from dovetail import LLM, PoolingParams, SamplingParams
from dovetail.errors import ConfigError, RequestError
from dovetail.pooling import resolve_pooler_config

COMMON = dict(device="cpu", dtype="float32", max_model_len=64)
#: Three prompts that a 16-token budget splits into chunks (and a 2-token one that fits a step).
PROMPTS = [list(range(5, 45)), [7, 8], list(range(60, 81)), list(range(100, 164))]


def save_base_model(path, seed: int = 0, **overrides):
    """A tiny Qwen3 base model (architectures ``Qwen3Model``: no LM head, names without ``model.``)."""
    values = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.1)
    values.update(overrides)
    torch.manual_seed(seed)
    Qwen3Model(Qwen3Config(**values)).save_pretrained(str(path))
    tiny_models.build_tokenizer(path, vocab_size=300)
    return path


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_base_model(tmp_path_factory.mktemp("qwen3-embedding"), is_matryoshka=True)


@pytest.fixture(scope="module")
def hf_states(base_dir):
    """HF's last hidden states of each of :data:`PROMPTS`."""
    model = AutoModel.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3Model"
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]


def pooled(states: torch.Tensor, pooling_type: str) -> torch.Tensor:
    return {"LAST": states[-1], "MEAN": states.mean(0), "CLS": states[0]}[pooling_type]


def embeddings(outputs) -> list[torch.Tensor]:
    return [torch.tensor(o.outputs.embedding) for o in outputs]


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_each_pooling_type_matches_hf_over_chunked_prompts(base_dir, hf_states, pooling_type):
    llm = LLM(str(base_dir), max_num_batched_tokens=16, pooler_config={"pooling_type": pooling_type}, **COMMON)
    engine = llm.llm_engine
    assert engine.is_pooling and engine.config.model.runner == "pooling", "a base model embeds by itself"
    assert engine.config.cache.enable_prefix_caching is (pooling_type == "LAST")
    outputs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    for got, states in zip(embeddings(outputs), hf_states):
        expected = torch.nn.functional.normalize(pooled(states, pooling_type), dim=0)
        assert got.shape == (64,)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    assert not engine.has_unfinished_requests() and engine.kv_manager.usage() == 0.0


def test_a_causal_lm_checkpoint_embeds_with_runner_pooling(tiny_llama_dir, tiny_llama_hf):
    llm = LLM(str(tiny_llama_dir), runner="pooling", pooler_config={"pooling_type": "MEAN", "normalize": False},
              **COMMON)
    assert llm.llm_engine.model.lm_head.weight.numel() == 0, "the untied LM head's memory is given back"
    prompts = ["hello world, the quick brown fox", "1 + 2 = 3"]
    outputs = llm.embed(prompts, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    with torch.no_grad():
        for prompt, output in zip(prompts, outputs):
            ids = tokenizer(prompt)["input_ids"]
            assert output.prompt_token_ids == ids and output.prompt == prompt
            states = tiny_llama_hf.model(torch.tensor([ids])).last_hidden_state[0]
            torch.testing.assert_close(torch.tensor(output.outputs.embedding), states.mean(0), atol=2e-5, rtol=1e-4)


def test_dimensions_normalize_and_prefix_hits(base_dir, hf_states):
    llm = LLM(str(base_dir), **COMMON)
    full, cut, raw = llm.embed([{"prompt_token_ids": PROMPTS[3]}] * 3, [
        PoolingParams(), PoolingParams(dimensions=16), PoolingParams(normalize=False)], use_tqdm=False)
    last = hf_states[3][-1]
    torch.testing.assert_close(torch.tensor(raw.outputs.embedding), last, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(cut.outputs.embedding),
                               torch.nn.functional.normalize(last[:16], dim=0), atol=2e-5, rtol=1e-4)
    assert full.outputs.hidden_size == 64 and cut.outputs.hidden_size == 16
    again = llm.embed({"prompt_token_ids": PROMPTS[3]}, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0, "LAST pooling keeps prefix caching"
    torch.testing.assert_close(torch.tensor(again.outputs.embedding), torch.tensor(full.outputs.embedding))


def test_bad_requests_are_named(base_dir, tiny_llama_dir, tmp_path):
    llm = LLM(str(base_dir), **COMMON)
    cases = [
        (lambda: llm.embed({"prompt_token_ids": list(range(65))}), "input", "the prompt has 65 tokens"),
        (lambda: llm.embed({"prompt_token_ids": [5, 999]}), "prompt_token_ids", "token id 999 is out of range"),
        (lambda: llm.embed({"prompt_token_ids": []}), "input", "the prompt is empty"),
        (lambda: llm.embed("hi", PoolingParams(dimensions=65)), "dimensions", "65 is not among"),
        (lambda: llm.generate("hi", SamplingParams(max_tokens=2)), "model", "runs as a pooling model"),
        (lambda: PoolingParams(dimensions=0), "dimensions", "greater than or equal to 1"),
    ]
    for call, field, text in cases:
        with pytest.raises(RequestError) as caught:
            call()
        assert caught.value.field == field and text in str(caught.value), str(caught.value)
    at_the_limit = llm.embed({"prompt_token_ids": list(range(1, 65))}, use_tqdm=False)[0]
    assert len(at_the_limit.outputs.embedding) == 64, "a prompt of max_model_len tokens embeds"
    assert not llm.llm_engine.has_unfinished_requests()

    plain = save_base_model(tmp_path / "plain", seed=1)
    with pytest.raises(RequestError, match="dimensions: this model does not support Matryoshka"):
        LLM(str(plain), **COMMON).embed("hi", PoolingParams(dimensions=8))
    with pytest.raises(RequestError, match="start it with runner='pooling'"):
        LLM(str(tiny_llama_dir), **COMMON).embed("hi")
    with pytest.raises(ConfigError, match="pooler_config: pooling_type: Input should be 'LAST', 'MEAN' or 'CLS'"):
        LLM(str(base_dir), pooler_config={"pooling_type": "MAX"}, **COMMON)


def test_truncate_prompt_tokens_keeps_the_last_tokens(base_dir):
    llm = LLM(str(base_dir), **COMMON)
    long_ids = list(range(1, 101))
    cut, whole, same = llm.embed([{"prompt_token_ids": long_ids}, {"prompt_token_ids": long_ids},
                                  {"prompt_token_ids": long_ids[-10:]}],
                                 [PoolingParams(truncate_prompt_tokens=10), PoolingParams(truncate_prompt_tokens=-1),
                                  PoolingParams()], use_tqdm=False)
    assert cut.prompt_token_ids == long_ids[-10:] and whole.prompt_token_ids == long_ids[-64:]
    assert cut.outputs.embedding == same.outputs.embedding
    text = "hello world, the quick brown fox jumps over the lazy dog. " * 40  # far beyond 64 tokens
    with pytest.raises(RequestError, match="prompt: the prompt has 2320 characters"):
        llm.embed(text)
    (truncated,) = llm.embed(text, PoolingParams(truncate_prompt_tokens=12), use_tqdm=False)
    expected = llm.get_tokenizer()(text)["input_ids"][-12:]
    assert truncated.prompt_token_ids == expected
    with pytest.raises(RequestError, match="truncate_prompt_tokens: .*must be -1 .* or at least 1") as caught:
        PoolingParams(truncate_prompt_tokens=0)
    assert caught.value.field == "truncate_prompt_tokens"


def test_sentence_transformers_files_choose_the_pooling(tmp_path):
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}))
    assert resolve_pooler_config(tmp_path, None) == {"pooling_type": "MEAN", "normalize": True}
    assert resolve_pooler_config(tmp_path, {"pooling_type": "CLS", "normalize": False}) == {
        "pooling_type": "CLS", "normalize": False}
    assert resolve_pooler_config(tmp_path / "none", None) == {"pooling_type": "LAST", "normalize": True}
    modules = json.loads((tmp_path / "modules.json").read_text())
    (tmp_path / "modules.json").write_text(json.dumps(modules + [
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(ConfigError, match="has Dense module.s., which Dovetail does not apply"):
        resolve_pooler_config(tmp_path, {"pooling_type": "MEAN"})
    (tmp_path / "1_Pooling" / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="sentence-transformers files .* cannot be read"):
        resolve_pooler_config(tmp_path, None)


def test_two_ranks_embed_as_one(base_dir, hf_states):
    llm = LLM(str(base_dir), tensor_parallel_size=2, max_num_batched_tokens=16,
              pooler_config={"pooling_type": "MEAN"}, **COMMON)
    try:
        outputs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    for got, states in zip(embeddings(outputs), hf_states):
        torch.testing.assert_close(got, torch.nn.functional.normalize(states.mean(0), dim=0), atol=2e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_cuda_embeddings_match_hf(base_dir, hf_states, dtype, tol):
    kwargs = dict(COMMON, device="cuda", dtype=dtype, max_num_batched_tokens=16, gpu_memory_utilization=0.3)
    for pooling_type in ("LAST", "MEAN"):
        llm = LLM(str(base_dir), pooler_config={"pooling_type": pooling_type}, **kwargs)
        outputs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
        for got, states in zip(embeddings(outputs), hf_states):
            expected = torch.nn.functional.normalize(pooled(states, pooling_type), dim=0)
            torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
        llm.llm_engine.shutdown()
        del llm
