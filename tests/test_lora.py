"""LoRA adapters (``enable_lora``): greedy tokens and logprobs against PEFT's own model with the adapter merged
into the same base weights, for several adapters and the base model in one batch, at one rank and at two;
the slots, the scheduler's limit and the host copies under pressure; refusals naming the field; the server's
``--lora-modules`` over a real socket."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import tiny_models
from dovetail import LLM, SamplingParams
from dovetail.errors import ConfigError, RequestError
from dovetail.lora import LoRARequest

EVERY_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: A block of 16 tokens and more (so that prefix caching has full blocks to share), a short one, a long one.
PROMPTS = [list(range(5, 25)), list(range(30, 42)), list(range(50, 90))]
MAX_TOKENS = 10
COMMON = dict(device="cpu", dtype="float32", max_model_len=128, enable_lora=True)
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=3)


def save_adapter(base_dir, path, seed: int, rank: int, targets: list[str], **config):
    """A PEFT LoRA adapter of ``base_dir`` with random ``A`` and ``B`` (PEFT starts ``B`` at zero), saved by
    PEFT; returns PEFT's model with it merged, the reference."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(tiny_models.load_hf(base_dir),
                           LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0, **config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.2)
    model.save_pretrained(str(path), save_embedding_layers=False)
    return model.merge_and_unload().eval()


def save_adapters(base_dir, root) -> dict:
    """name -> (LoRARequest, the merged reference model); ``None`` is the base model."""
    every = save_adapter(base_dir, root / "every", 1, 8, EVERY_LINEAR)
    some = save_adapter(base_dir, root / "some", 2, 4, ["q_proj", "v_proj", "down_proj"], use_rslora=True)
    return {"every": (LoRARequest("every", 1, str(root / "every")), every),
            "some": (LoRARequest("some", 2, str(root / "some")), some),
            None: (None, tiny_models.load_hf(base_dir))}


def expected_outputs(adapters) -> dict:
    """(prompt index, adapter name) -> the reference's greedy tokens and top logprobs."""
    table = {}
    for name, (_, model) in adapters.items():
        for i, completion in enumerate(reference_completions(model)):
            table[i, name] = completion
    return table


def reference_completions(model) -> list:
    """Each of PROMPTS' greedy tokens under HF's ``model`` and, per step, its top-3 logprobs."""
    completions = []
    for prompt in PROMPTS:
        tokens, logprobs = tiny_models.hf_greedy(model, prompt, MAX_TOKENS)
        completions.append((tokens, [{t: float(lp[t]) for t in lp.topk(3).indices.tolist()} for lp in logprobs]))
    return completions


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    return save_adapters(tiny_llama_dir, tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def expected(adapters):
    return expected_outputs(adapters)


def generate(llm: LLM, adapters, jobs: list[tuple[int, str | None]]):
    outputs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i, _ in jobs], GREEDY, use_tqdm=False,
                           lora_request=[adapters[name][0] for _, name in jobs])
    return tiny_models.completions(outputs)


def check(llm: LLM, adapters, expected, jobs: list[tuple[int, str | None]], tol: float = 1e-4) -> None:
    tiny_models.check_matches(generate(llm, adapters, jobs), [expected[job] for job in jobs], tol)


#: Every prompt with every adapter and without, interleaved; the same prompt under several adapters shares
#: no cached block.
MIXED = [(i, name) for i in range(len(PROMPTS)) for name in ("every", None, "some")]


def test_adapters_and_the_base_model_in_one_batch_match_peft(tiny_llama_dir, adapters, expected):
    llm = LLM(str(tiny_llama_dir), max_loras=2, max_lora_rank=8, max_num_batched_tokens=32, **COMMON)
    check(llm, adapters, expected, MIXED)
    hits = llm.llm_engine.kv_manager.prefix_hits
    check(llm, adapters, expected, MIXED[::-1])  # again: every prompt's first block is now cached, per adapter
    assert llm.llm_engine.kv_manager.prefix_hits > hits


def test_beam_search_runs_with_the_adapter(tiny_llama_dir, adapters):
    from dovetail import BeamSearchParams

    llm = LLM(str(tiny_llama_dir), max_lora_rank=8, **COMMON)
    prompt = {"prompt_token_ids": PROMPTS[1]}
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    reference = adapters["some"][1].generate(torch.tensor([PROMPTS[1]]), num_beams=2, num_return_sequences=2,
                                             max_new_tokens=4, min_new_tokens=4, do_sample=False, eos_token_id=None,
                                             pad_token_id=0, length_penalty=1.0, early_stopping=True)
    (got,) = llm.beam_search([prompt], params, lora_request=adapters["some"][0])
    assert [b.tokens for b in got.sequences] == reference.tolist()
    (base,) = llm.beam_search([prompt], params)
    assert [b.tokens for b in base.sequences] != reference.tolist()


def test_one_slot_runs_the_adapters_in_turn_and_reads_them_again(tiny_llama_dir, adapters, expected, tmp_path):
    llm = LLM(str(tiny_llama_dir), max_loras=1, max_cpu_loras=1, max_lora_rank=8, **COMMON)
    engine = llm.llm_engine
    jobs = [(0, "every"), (1, "some"), (2, "every"), (0, None), (1, "some")]
    for n, (i, name) in enumerate(jobs):
        engine.add_request(f"r{n}", {"prompt_token_ids": PROMPTS[i]}, GREEDY, lora_request=adapters[name][0])
    finished, adapters_at_once = {}, set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        running = {r.lora_request.lora_int_id for r in engine.scheduler.running if r.lora_request is not None}
        adapters_at_once.add(len(running))
    assert adapters_at_once <= {0, 1} and 1 in adapters_at_once
    got = tiny_models.completions([finished[f"r{n}"] for n in range(len(jobs))])
    tiny_models.check_matches(got, [expected[job] for job in jobs])
    copy = tmp_path / "copy"
    shutil.copytree(adapters["some"][0].lora_path, copy)
    outputs = llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("copy", 3, str(copy)), use_tqdm=False)
    tiny_models.check_matches(tiny_models.completions(outputs), [expected[0, "some"]])
    assert list(engine.loras.adapters) == [3]  # max_cpu_loras=1: the others were forgotten
    with pytest.raises(RequestError, match="1 already names the adapter at"):  # forgotten, but still its folder
        llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("copy", 1, str(copy)), use_tqdm=False)
    check(llm, adapters, expected, [(2, "every"), (1, "some")])  # read again, each into the one slot in turn


def test_two_ranks_match_peft_and_survive_a_broken_adapter(tiny_llama_dir, adapters, expected, tmp_path):
    llm = LLM(str(tiny_llama_dir), max_loras=2, max_lora_rank=8, tensor_parallel_size=2,
              distributed_executor_backend="mp", **COMMON)
    try:
        check(llm, adapters, expected, MIXED)
        broken = tmp_path / "broken"
        shutil.copytree(adapters["some"][0].lora_path, broken)
        (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
        with pytest.raises(RequestError, match="unreadable adapter_model.safetensors") as info:
            llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("broken", 9, str(broken)), use_tqdm=False)
        assert info.value.field == "lora_request"
        check(llm, adapters, expected, [(1, "some"), (2, None)])  # every rank still serves
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 2])
def test_cuda_adapters_match_peft_and_decode_graphs_replay_them(tmp_path, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    base = tiny_models.save_model(tmp_path / "base", tiny_models.tiny_llama_config(
        hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64))  # a head size TRITON takes
    adapters = save_adapters(base, tmp_path)
    common = dict(COMMON, device="cuda", max_loras=2, max_lora_rank=8, max_num_batched_tokens=32,
                  gpu_memory_utilization=0.3, tensor_parallel_size=tp)
    _release_gpu_memory()  # an engine's cache in this process would count against the ranks' budgets
    llm = LLM(str(base), **common)  # float32: against PEFT's float32 model
    check(llm, adapters, expected_outputs(adapters), MIXED, tol=1e-3)
    llm.llm_engine.shutdown()
    runs = {}
    for eager in (True, False):  # bfloat16 on TRITON, whose decode steps replay graphs unless eager
        del llm
        _release_gpu_memory()
        llm = LLM(str(base), attention_backend="TRITON", enforce_eager=eager, **dict(common, dtype="bfloat16"))
        ranks = llm.llm_engine.executor.collective_rpc("describe")
        assert all((rank["graph_sizes"] is None) == eager for rank in ranks) and len(ranks) == tp
        runs[eager] = generate(llm, adapters, MIXED)
        llm.llm_engine.shutdown()
    tiny_models.check_matches(runs[False], runs[True], tol=1e-3)


def _release_gpu_memory() -> None:
    import gc

    gc.collect()
    torch.cuda.empty_cache()


def _copy_with_config(source: str, path, lora_int_id: int, **changes) -> LoRARequest:
    shutil.copytree(source, path)
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))
    return LoRARequest(path.name, lora_int_id, str(path))


def test_refusals_name_the_field_and_leave_the_engine_serving(tiny_llama_dir, adapters, expected, tmp_path):
    llm = LLM(str(tiny_llama_dir), max_lora_rank=4, **COMMON)
    every, some = adapters["every"][0], adapters["some"][0]
    head = tmp_path / "head"
    save_adapter(tiny_llama_dir, head, 3, 4, ["lm_head"])
    cases = [
        (every, "changes 'model.layers.0.mlp.down_proj', with rank 8, above max_lora_rank=4"),
        (LoRARequest("missing", 3, str(tmp_path / "missing")), "has no adapter_config.json"),
        (_copy_with_config(some.lora_path, tmp_path / "dora", 5, use_dora=True), "uses DoRA"),
        (_copy_with_config(some.lora_path, tmp_path / "bias", 6, bias="all"), "trains biases"),
        (LoRARequest("head", 4, str(head)), "changes 'lm_head', which is not a linear layer of this model"),
        (LoRARequest("other", 2, every.lora_path), "2 already names the adapter at"),
    ]
    check(llm, adapters, expected, [(0, "some")])
    for request, message in cases:
        with pytest.raises(RequestError, match=message) as info:
            llm.generate([PROMPTS[0]], GREEDY, lora_request=request, use_tqdm=False)
        assert info.value.field == "lora_request"
    check(llm, adapters, expected, [(1, "some"), (0, None)])
    with pytest.raises(RequestError, match="lora_request: got 1 for 2 prompts"):
        llm.generate(PROMPTS[:2], GREEDY, lora_request=[some], use_tqdm=False)


def test_an_adapter_on_a_mixture_of_experts_models_attention_matches_peft(tmp_path):
    from test_models_vs_hf import CASES, save_checkpoint

    base = save_checkpoint(tmp_path / "base", CASES["qwen3moe-normtopk-dense-layer"]())
    reference = save_adapter(base, tmp_path / "attention", 5, 8, ["q_proj", "k_proj", "v_proj", "o_proj"])
    save_adapter(base, tmp_path / "experts", 6, 8, ["q_proj", "down_proj"])
    llm = LLM(str(base), max_lora_rank=8, **COMMON)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False,
                           lora_request=LoRARequest("attention", 1, str(tmp_path / "attention")))
    expected = reference_completions(reference)
    tiny_models.check_matches(tiny_models.completions(outputs), expected)
    with pytest.raises(RequestError, match=r"changes 'model.layers.0.mlp.experts', which is not a linear layer"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("experts", 2, str(tmp_path / "experts")),
                     use_tqdm=False)


def test_an_adapter_on_a_gptq_checkpoint_matches_peft_on_its_dequantised_weights(tmp_path):
    """The update adds to a quantized layer's output: GPTQ's 4-bit weights with an adapter give PEFT's tokens on
    the same weights dequantised (log-probabilities within 1e-3, as the GPTQ checkpoint alone does)."""
    from test_quant_checkpoints import build_gptq, dequantised_hf

    base = tiny_models.save_model(tmp_path / "float", tiny_models.tiny_llama_config(
        hidden_size=128, intermediate_size=256))
    checkpoint, refs = build_gptq(base, tmp_path / "gptq", group_size=32, desc_act=True, sym=True)
    dequantised_hf(base, tmp_path / "dequantised", refs)
    reference = save_adapter(tmp_path / "dequantised", tmp_path / "adapter", 7, 8, EVERY_LINEAR)
    llm = LLM(str(checkpoint), max_lora_rank=8, **COMMON)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False,
                           lora_request=LoRARequest("adapter", 1, str(tmp_path / "adapter")))
    expected = reference_completions(reference)
    assert llm.llm_engine.quant_method.name == "gptq"
    tiny_models.check_matches(tiny_models.completions(outputs), expected, tol=1e-3)


def test_configurations_that_cannot_serve_adapters(tiny_llama_dir, adapters, tmp_path):
    with pytest.raises(ConfigError, match="max_cpu_loras: .*at least max_loras"):
        LLM(str(tiny_llama_dir), max_loras=2, max_cpu_loras=1, **COMMON)
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=128)
    with pytest.raises(RequestError, match="LoRA adapters are not enabled"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=adapters["some"][0], use_tqdm=False)
    from test_pooling import save_base_model

    with pytest.raises(ConfigError, match="enable_lora: LoRA adapters run on generating models only"):
        LLM(str(save_base_model(tmp_path / "embed")), **COMMON)


def test_the_server_serves_adapters_as_models_and_loads_them_at_run_time(tiny_llama_dir, adapters, expected,
                                                                          tmp_path):
    import httpx
    from transformers import AutoTokenizer

    from test_server_cli import ServerProcess

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    some, every = adapters["some"][0], adapters["every"][0]
    server = ServerProcess(tiny_llama_dir, "--served-model-name", "base", "--max-model-len", "128",
                           "--enable-lora", "--max-lora-rank", "8", "--lora-modules",
                           json.dumps({"name": "some", "path": some.lora_path}),
                           env={"DOVETAIL_ALLOW_RUNTIME_LORA_UPDATING": "true"})

    def complete(model: str) -> httpx.Response:
        return httpx.post(server.url("/v1/completions"), json={
            "model": model, "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 1})

    def post(path: str, **body) -> httpx.Response:
        return httpx.post(server.url(path), json=body)

    try:
        loaded = post("/v1/load_lora_adapter", lora_name="every", lora_path=every.lora_path)
        assert loaded.status_code == 200 and "every" in loaded.text
        models = httpx.get(server.url("/v1/models")).json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [("base", None), ("some", "base"), ("every", "base")]
        assert models[1]["root"] == some.lora_path
        for model, name in (("some", "some"), ("every", "every"), ("base", None)):
            reply = complete(model).json()
            assert reply["model"] == model
            assert reply["choices"][0]["text"] == tokenizer.decode(expected[1, name][0], skip_special_tokens=True)
            first = max(expected[1, name][1][0].items(), key=lambda kv: kv[1])
            assert reply["choices"][0]["logprobs"]["token_logprobs"][0] == pytest.approx(first[1], abs=1e-4)
        missing = complete("nope")
        assert missing.status_code == 404 and "'some'" in missing.json()["error"]["message"]
        for body, field, message in (({"lora_name": "some", "lora_path": every.lora_path}, "lora_name",
                                      "already served"),
                                     ({"lora_name": "x", "lora_path": str(tmp_path)}, "lora_path",
                                      "has no adapter_config.json"),
                                     ({"lora_name": "x"}, "lora_path", "")):
            refused = post("/v1/load_lora_adapter", **body)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
            assert message in refused.json()["error"]["message"]
        assert post("/v1/unload_lora_adapter", lora_name="every").status_code == 200
        assert complete("every").status_code == 404
        gone = post("/v1/unload_lora_adapter", lora_name="every")
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"
        assert complete("some").status_code == 200
    finally:
        server.stop()


def test_runtime_loading_needs_lora_and_the_variable():
    from dovetail.server.lora_adapters import runtime_updating_allowed

    assert runtime_updating_allowed(True, {"DOVETAIL_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert not runtime_updating_allowed(False, {"DOVETAIL_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    assert not runtime_updating_allowed(True, {"DOVETAIL_ALLOW_RUNTIME_LORA_UPDATING": "0"})
    assert not runtime_updating_allowed(True, {})


def test_lora_modules_flag_is_checked_before_the_model_loads(adapters):
    from dovetail.cli.serve_cmd import parse_lora_modules

    path = adapters["some"][0].lora_path
    assert parse_lora_modules([f"a={path}"], True, ["base"]) == {"a": LoRARequest("a", 1, path)}
    for items, enabled, message in (([f"a={path}"], False, "needs --enable-lora"), (["a"], True, "not NAME=PATH"),
                                    ([f"base={path}"], True, "given twice"), (['{"name": "a"}'], True, "JSON object"),
                                    (["a=/nowhere"], True, "a: the adapter at '/nowhere' has no adapter_config")):
        with pytest.raises(ConfigError, match=message):
            parse_lora_modules(items, enabled, ["base"])
