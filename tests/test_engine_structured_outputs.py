"""Structured outputs in the engine: constraints, the grammar cache and compile pool, bitmasks, n > 1,
overlapped steps, preemption, and errors (on the CPU, with the tiny random Llama)."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from dovetail.errors import RequestError
from dovetail.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["name", "age", "pet"],
}
PROMPTS = ["hello world", "the quick brown fox", "1 + 2 = 3", "def f(x):"]
#: Tokens of the tiny tokenizer are ids 0..299; the model's logits have 320 entries.
TOKENIZER_SIZE = 300


@pytest.fixture(scope="module", params=[False, True], ids=["steps-in-turn", "overlapped-steps"])
def llm(request, tiny_llama_dir):
    from dovetail import LLM

    return LLM(str(tiny_llama_dir), max_model_len=256, async_scheduling=request.param)


def _constrained(seed: int, **spec) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=60,
                          structured_outputs=StructuredOutputsParams(**spec))


def test_json_schema_outputs_that_stop_validate(llm):
    params = [_constrained(i, json=SCHEMA, disable_any_whitespace=True) for i in range(8)]
    outputs = llm.generate(PROMPTS * 2, params, use_tqdm=False)
    stopped = [o.outputs[0] for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert len(stopped) >= 4, [o.outputs[0].text for o in outputs]
    for out in stopped:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    for o in outputs:  # cut short or not, each output is a prefix the schema allows
        assert o.outputs[0].text.startswith('{"name": "')


def test_choice_regex_and_grammar_with_n_samples(llm):
    choices = ['yes', 'no', 'say "maybe"']
    out = llm.generate("hello world", SamplingParams(temperature=1.0, seed=1, n=6, max_tokens=20,
                                                     structured_outputs=StructuredOutputsParams(choice=choices)),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == list(range(6))
    assert all(c.text in choices and c.finish_reason == "stop" for c in out.outputs)
    pattern = r"\d{3}-[a-z]{2,4}"
    for o in llm.generate(PROMPTS, [_constrained(i, regex=pattern) for i in range(4)], use_tqdm=False):
        assert re.fullmatch(pattern, o.outputs[0].text) and o.outputs[0].finish_reason == "stop"
    ebnf = 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'
    lark = 'start: "<" WORD ">"\nWORD: /[a-z]+/'
    for grammar, shape in ((ebnf, r"\(\d+(\+\d+)*\)"), (lark, r"<[a-z]+>")):
        outs = llm.generate(PROMPTS, [_constrained(i, grammar=grammar) for i in range(4)], use_tqdm=False)
        done = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
        assert done and all(re.fullmatch(shape, text) for text in done), [o.outputs[0].text for o in outs]


def test_json_object_is_any_json_object(llm):
    spec = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec), use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(t.startswith(("{", "[")) for t in texts), texts
    for o in outs:
        if o.outputs[0].finish_reason == "stop":
            json.loads(o.outputs[0].text)


def test_a_permissive_grammar_changes_no_token(llm):
    # Any text is allowed, but xgrammar never allows bytes that cannot be UTF-8 (random models emit them):
    # both runs ban the tokens outside printable ASCII, so where they differ the mask is to blame.
    tokenizer = llm.get_tokenizer()
    texts = {i: tokenizer.decode([i], skip_special_tokens=True) for i in range(TOKENIZER_SIZE)}
    printable = {i for i, text in texts.items() if text and all(32 <= ord(ch) < 127 or ch == "\n" for ch in text)}
    ban = {i: -100.0 for i in range(320) if i not in printable and i != 1}
    free = SamplingParams(temperature=0, max_tokens=24, logit_bias=ban)
    permissive = free.model_copy(update={"structured_outputs": StructuredOutputsParams(regex=r"[\s\S]*")})
    reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, free, use_tqdm=False)]
    mixed = llm.generate(PROMPTS * 2, [permissive] * 4 + [free] * 4, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed] == reference * 2
    assert any(len(t) == 24 for t in reference)


def test_the_grammar_forbids_tokens_beyond_the_tokenizer(llm):
    # Token 310 has logits but no text: a +100 bias makes it the greedy choice unless a grammar rules it out.
    biased = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={310: 100.0})
    assert llm.generate("hello", biased, use_tqdm=False)[0].outputs[0].token_ids == [310] * 8
    constrained = biased.model_copy(update={"structured_outputs": StructuredOutputsParams(regex=r"[a-z ]+")})
    out = llm.generate("hello", constrained, use_tqdm=False)[0].outputs[0]
    assert all(t < TOKENIZER_SIZE for t in out.token_ids) and re.fullmatch(r"[a-z ]+", out.text)


def test_with_ignore_eos_the_end_of_the_grammar_stops_the_request(llm):
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]))
    out = llm.generate("hello", params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("alpha", "beta") and out.finish_reason == "stop"
    assert out.token_ids[-1] == 1 and len(out.token_ids) < 50  # the EOS the grammar allowed, then nothing


def test_each_distinct_constraint_is_compiled_once(llm):
    manager = llm.llm_engine.structured
    spec = {"type": "object", "properties": {"unique": {"type": "integer"}}}
    before = len(manager.compile_seconds)
    params = [_constrained(i, json=spec) for i in range(3)]
    llm.generate(PROMPTS[:3], params, use_tqdm=False)
    llm.generate(PROMPTS[:1], _constrained(9, json=json.dumps(spec)), use_tqdm=False)  # same schema as text
    assert len(manager.compile_seconds) == before + 1


@pytest.mark.parametrize("spec,field", [
    ({"json": {"type": "object", "properties": 3}}, "structured_outputs.json"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"regex": "[a-"}, "structured_outputs.regex"),
    ({"grammar": "root ::= missing_rule"}, "structured_outputs.grammar"),
    ({"structural_tag": "{}"}, "structured_outputs.structural_tag"),
])
def test_a_malformed_constraint_is_a_request_error_naming_the_field(llm, spec, field):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**spec))
    with pytest.raises(RequestError) as info:
        llm.llm_engine.add_request(None, "hello", params)
    assert info.value.field == field and str(info.value).startswith(field)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("spec", [{}, {"json": {}, "regex": "a"}, {"choice": []}])
def test_exactly_one_constraint(spec):
    with pytest.raises(RequestError) as info:
        StructuredOutputsParams(**spec)
    assert info.value.field == "structured_outputs"
    with pytest.raises(RequestError) as info:
        SamplingParams(structured_outputs=spec)
    assert info.value.field == "structured_outputs"


def test_a_slow_grammar_holds_up_only_its_own_requests(tiny_llama_dir, monkeypatch):
    from dovetail.engine.llm_engine import LLMEngine
    from dovetail.engine.structured_output import StructuredOutputManager

    release = threading.Event()
    compile_grammar = StructuredOutputManager._compile

    def slow_compile(self, grammar):
        assert release.wait(60), "the test never released the grammar"
        return compile_grammar(self, grammar)

    monkeypatch.setattr(StructuredOutputManager, "_compile", slow_compile)
    engine = LLMEngine.from_engine_args(str(tiny_llama_dir), max_model_len=256)
    slow = SamplingParams(temperature=0, max_tokens=10, structured_outputs=StructuredOutputsParams(regex="[a-z]{3}"))
    engine.add_request("slow-1", "hello", slow)
    engine.add_request("plain", "hello", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    engine.add_request("slow-2", "the fox", slow)
    finished = {}
    while "plain" not in finished:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"plain"} and len(finished["plain"].outputs[0].token_ids) == 10
    assert all(r.num_output_tokens == 0 for r in engine.scheduler.waiting)
    assert {r.request_id for r in engine.scheduler.waiting} == {"slow-1", "slow-2"}
    release.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    for rid in ("slow-1", "slow-2"):
        assert re.fullmatch("[a-z]{3}", finished[rid].outputs[0].text)


def test_preempted_constrained_requests_keep_their_grammar_state(tiny_llama_dir):
    from dovetail import LLM

    params = [_constrained(i, json=SCHEMA, disable_any_whitespace=True) for i in range(8)]
    prompts = [p * 3 for p in PROMPTS] * 2
    roomy = LLM(str(tiny_llama_dir), max_model_len=256, async_scheduling=True)
    reference = [o.outputs[0].text for o in roomy.generate(prompts, params, use_tqdm=False)]
    del roomy
    tight = LLM(str(tiny_llama_dir), max_model_len=256, block_size=16, num_gpu_blocks_override=24,
                async_scheduling=True)
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].text for o in outputs] == reference


def test_a_matcher_that_falls_out_of_step_is_rolled_back_or_fed(llm):
    """The matcher always stands for the output tokens, whatever happened between two masks."""
    from dovetail.engine.request import Request
    from dovetail.engine.structured_output import GrammarState

    engine = llm.llm_engine
    spec = StructuredOutputsParams(regex="(a b )*a b c")
    future = engine.structured.grammar_for(spec)
    future.result()
    ids = engine.tokenizer.encode("a b a b", add_special_tokens=False)
    request = Request("r", None, [5], SamplingParams(structured_outputs=spec), engine.eos_token_ids)
    request.grammar = GrammarState(future, reasoning_ended=True)
    for token in ids:
        request.append_token(token)
        assert not engine.structured.accept(request, token)
    mask_after_ab, _ = engine.structured.bitmask([request])
    del request.output_token_ids[-2:]  # as if the last tokens were taken back: the matcher rolls back
    del request.all_token_ids[-2:]
    engine.structured.bitmask([request])
    assert request.grammar.num_accepted == len(request.output_token_ids)
    for token in ids[-2:]:
        request.append_token(token)  # and fed again without accept(): the next mask catches up
    again, rows = engine.structured.bitmask([request])
    assert rows == [0] and bool((again == mask_after_ab).all())


def test_the_engine_loop_serves_plain_requests_while_grammars_compile(tiny_llama_dir, monkeypatch):
    import asyncio

    from dovetail.engine.async_engine import AsyncLLMEngine, NewRequest
    from dovetail.engine.llm_engine import LLMEngine
    from dovetail.engine.structured_output import StructuredOutputManager

    release = threading.Event()
    compile_grammar = StructuredOutputManager._compile
    monkeypatch.setattr(StructuredOutputManager, "_compile",
                        lambda self, grammar: release.wait(60) and compile_grammar(self, grammar))
    slow = SamplingParams(temperature=0, max_tokens=5, structured_outputs=StructuredOutputsParams(regex="[0-9]{2}"))
    plain = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    async def scenario():
        engine = AsyncLLMEngine(LLMEngine.from_engine_args(str(tiny_llama_dir), max_model_len=256))
        engine.start()
        try:
            slow_streams = [await engine.add([NewRequest(f"slow-{i}", "hello", slow)]) for i in range(2)]
            outputs = [item.output async for item in await engine.add([NewRequest("plain", "hello", plain)])]
            assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 5
            assert all(s._pending == {} for s in slow_streams)  # nothing from the constrained requests yet
            release.set()
            finals = [[item.output async for item in s][-1] for s in slow_streams]
            return [f.outputs[0].text for f in finals]
        finally:
            release.set()
            await engine.shutdown()

    texts = asyncio.run(scenario())
    assert all(re.fullmatch("[0-9]{2}", t) for t in texts)


def test_cli_generate_follows_a_schema_file_or_a_regex(tiny_llama_dir, tmp_path, capsys):
    from dovetail.cli.main import main

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}))
    base = ["--log-level", "WARNING", "generate", "--model", str(tiny_llama_dir), "--max-model-len", "256",
            "--max-tokens", "40", "--json"]
    assert main([*base, "--json-schema", str(schema), "--temperature", "1", "--sampling-seed", "3", "--n", "4",
                 "hello"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    outputs = json.loads(line)["outputs"]
    assert any(o["finish_reason"] == "stop" for o in outputs)
    for o in outputs:
        if o["finish_reason"] == "stop":
            assert isinstance(json.loads(o["text"])["ok"], bool)
    assert main([*base, "--regex", "[0-9]{4}", "hello", "the fox"]) == 0
    texts = [json.loads(line)["outputs"][0]["text"] for line in capsys.readouterr().out.splitlines()]
    assert len(texts) == 2 and all(re.fullmatch("[0-9]{4}", t) for t in texts), texts
    schema.write_text('{"type": "object", "properties": 1}')
    assert main([*base, "--json-schema", str(schema), "hello"]) == 2
    assert capsys.readouterr().err.startswith("error: --json-schema: invalid JSON schema")


def test_a_grammar_that_fails_to_compile_aborts_only_its_request(tiny_llama_dir, monkeypatch, caplog):
    from dovetail.engine.llm_engine import LLMEngine
    from dovetail.engine.structured_output import StructuredOutputManager

    def broken(self, grammar):
        raise RuntimeError("[00:00:00] /x/compiler.cc:1: out of patience")

    monkeypatch.setattr(StructuredOutputManager, "_compile", broken)
    engine = LLMEngine.from_engine_args(str(tiny_llama_dir), max_model_len=256)
    spec = StructuredOutputsParams(regex="[a-z]+")
    engine.add_request("broken", "hello", SamplingParams(n=2, max_tokens=5, structured_outputs=spec))
    engine.add_request("plain", "hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert [c.finish_reason for c in finished["broken"].outputs] == ["abort", "abort"]
    assert len(finished["plain"].outputs[0].token_ids) == 5
    assert "its grammar failed to compile: out of patience" in caplog.text
