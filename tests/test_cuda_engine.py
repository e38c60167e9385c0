"""The whole engine on an NVIDIA GPU: greedy tokens against HF, CUDA graphs on and off,
one host synchronisation per step, and the KV cache sized from gpu_memory_utilization (GPU)."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

from dovetail import LLM, SamplingParams
from installed_backends import installed_attention_backend
from tiny_models import assert_greedy_matches, load_hf, save_model, tiny_llama_config

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 61)), [3], list(range(100, 117)), [42] * 33]
MAX_TOKENS = 24
ENGINE = dict(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.1, max_num_seqs=16)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A 2-layer GQA Llama with head size 128, the size the CUDA backends all take."""
    config = tiny_llama_config(hidden_size=512, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    return save_model(tmp_path_factory.mktemp("tiny-llama-h128"), config)


@pytest.fixture(scope="module")
def hf_reference(model_dir):
    """HF greedy in float32 on the GPU: the tokens, and each step's log-softmax."""
    model = load_hf(model_dir).cuda()
    results = []
    with torch.no_grad():
        for p in PROMPTS:
            out = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)
            results.append((out.sequences[0, len(p):].tolist(),
                            [torch.log_softmax(s[0].float(), -1).cpu() for s in out.logits]))
    del model
    torch.cuda.empty_cache()
    return results


def _greedy(llm, prompts=PROMPTS):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """An engine is a reference cycle (runner <-> graphs): collect it before the next test sizes its cache."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("backend", ["REFERENCE", "FLASHINFER", "TRITON", "FLASH_ATTN"])
def test_greedy_matches_hf(model_dir, hf_reference, backend):
    """float16 against HF's float32: tokens may differ only where HF's top two are within 0.05."""
    installed_attention_backend(backend)
    llm = LLM(str(model_dir), attention_backend=backend, **{**ENGINE, "dtype": "float16"})
    if backend != "REFERENCE":
        assert llm.llm_engine.runner.graphs is not None, "CUDA graphs are on by default"
    for tokens, (hf_tokens, hf_logprobs) in zip(_greedy(llm), hf_reference):
        assert_greedy_matches(tokens, hf_tokens, hf_logprobs, tol=0.05)


@pytest.mark.parametrize("backend", ["REFERENCE", "TRITON"])
def test_float32_matches_hf_within_float_error(model_dir, hf_reference, backend):
    """``dtype="float32"`` keeps float32 on the GPU (``"auto"`` would run this checkpoint in 16 bits): tokens as
    HF's but for ties within 1e-4, and each chosen token's logprob within 1e-4 of HF's."""
    llm = LLM(str(model_dir), attention_backend=backend, **{**ENGINE, "dtype": "float32"})
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for out, (hf_tokens, hf_logprobs) in zip(outputs, hf_reference):
        tokens = out.outputs[0].token_ids
        assert_greedy_matches(tokens, hf_tokens, hf_logprobs, tol=1e-4)
        for step, token in enumerate(tokens):
            if token != hf_tokens[step]:
                break
            assert abs(out.outputs[0].logprobs[step][token].logprob - float(hf_logprobs[step][token])) < 1e-4


@pytest.mark.parametrize("backend", ["FLASHINFER", "TRITON", "FLASH_ATTN"])
def test_graphs_on_and_off_give_identical_tokens(model_dir, backend):
    installed_attention_backend(backend)
    prompts = [list(range(10 + i, 40 + i)) for i in range(4)]  # 4 decodes: a captured size, no padding
    eager = LLM(str(model_dir), attention_backend=backend, enforce_eager=True, **ENGINE)
    assert eager.llm_engine.runner.graphs is None
    eager_tokens = _greedy(eager, prompts)
    del eager
    gc.collect()
    graphs = LLM(str(model_dir), attention_backend=backend, **ENGINE)
    replays = []
    original = graphs.llm_engine.runner.graphs.run
    graphs.llm_engine.runner.graphs.run = lambda *a: replays.append(1) or original(*a)
    assert _greedy(graphs, prompts) == eager_tokens
    assert len(replays) == MAX_TOKENS - 1, "every decode step should replay a graph"


def _sync_counts(engine, monkeypatch) -> tuple[list[int], list[int]]:
    """Per step: implicit synchronisations torch reports, and explicit waits for sampled tokens."""
    from dovetail_cuda import platform as cuda_platform

    waits = [0]
    original = cuda_platform._CudaHostCopy.wait

    def counted(self):
        waits[0] += 1
        return original(self)

    monkeypatch.setattr(cuda_platform._CudaHostCopy, "wait", counted)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"s{i}", {"prompt_token_ids": p}, SamplingParams(temperature=0.8, top_p=0.9,
                                                                          max_tokens=8, ignore_eos=True))
    implicit, explicit = [], []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        while engine.has_unfinished_requests():
            waits[0] = 0
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.step()
            implicit.append(sum("synchroniz" in str(w.message).lower() for w in caught))
            explicit.append(waits[0])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return implicit, explicit


@pytest.mark.parametrize("overlap", [False, True])
def test_each_step_waits_for_the_device_once(model_dir, monkeypatch, overlap):
    """The only host wait of a step is for the sampled tokens (a pinned copy and an event); with
    overlapped scheduling it waits for the step before, after launching its own."""
    llm = LLM(str(model_dir), attention_backend="TRITON", async_scheduling=overlap, **ENGINE)
    _greedy(llm, PROMPTS[:2])  # warm-up
    implicit, explicit = _sync_counts(llm.llm_engine, monkeypatch)
    assert implicit and all(c == 0 for c in implicit), implicit
    if overlap:
        assert explicit[0] == 0 and all(c == 1 for c in explicit[1:]), explicit
    else:
        assert all(c == 1 for c in explicit), explicit


def test_kv_cache_is_sized_from_gpu_memory_utilization(model_dir):
    llm = LLM(str(model_dir), attention_backend="TRITON", **{**ENGINE, "gpu_memory_utilization": 0.1})
    engine = llm.llm_engine
    total = torch.cuda.mem_get_info()[1]
    kv_bytes = engine.num_blocks * engine.runner.bytes_per_block()
    assert 0.05 * total < kv_bytes < 0.1 * total


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A 2-layer Qwen 3 (per-head q/k norms) with head size 128."""
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=320, hidden_size=512, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=512,
                         initializer_range=0.1, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    return save_model(tmp_path_factory.mktemp("tiny-qwen3-h128"), config)


@pytest.mark.parametrize("model", ["llama", "qwen3"])
def test_one_sequence_at_a_time_matches_hf(model, model_dir, qwen3_dir):
    """Batch-1 decode in CUDA graphs: the Triton GEMV for every linear but the LM head (the gate/up projection and
    SiLU in one gated GEMV), PDL between the kernels, and for Qwen 3 the q/k norms fused into the rotary kernel;
    float16 against HF's float32 greedy."""
    path = model_dir if model == "llama" else qwen3_dir
    hf = load_hf(path).cuda()
    llm = LLM(str(path), attention_backend="TRITON", **{**ENGINE, "dtype": "float16"})
    assert llm.llm_engine.runner.graphs is not None
    for prompt in PROMPTS[:3]:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=MAX_TOKENS,
                              min_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
        hf_tokens = out.sequences[0, len(prompt):].tolist()
        hf_logprobs = [torch.log_softmax(s[0].float(), -1).cpu() for s in out.logits]
        assert_greedy_matches(_greedy(llm, [prompt])[0], hf_tokens, hf_logprobs, tol=0.05)
