"""Speculative decoding by n-gram lookup (``speculative_config``): proposals, verification and the engine.

Draft tokens must never change what is generated: greedy tokens match HF, and greedy, seeded, penalised,
``min_tokens``, stop-string, ``n`` and preempted requests give with drafts exactly the tokens (and logprobs)
they give without, on one rank and at TP=2. A proposer that knows the right continuation, with one token
wrong, checks every branch of verification: drafts all kept (the extra token after them), cut at the
wrong one, and the computed positions of rejected drafts recomputed.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from dovetail import LLM, SamplingParams
from dovetail.cli.engine_args import add_engine_arguments, engine_kwargs
from dovetail.config import EngineArgs
from dovetail.engine.speculative import accepted_tokens, latest_match, ngram_proposal
from dovetail.errors import ConfigError
from tiny_models import assert_greedy_matches, hf_greedy

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
COMMON = dict(device="cpu", attention_backend="REFERENCE", dtype="float32", max_model_len=256)
#: Prompts that repeat themselves, so that n-grams find drafts, and one that does not.
PROMPTS = [[5, 6, 7, 8, 9] * 4, [40, 41, 42, 43, 44, 45, 46, 47] * 3, list(range(100, 131)), [7, 7, 7, 7]]


def _plain_latest_match(tokens: list[int], n: int) -> int | None:
    suffix = tokens[-n:]
    starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == suffix]
    return starts[-1] if starts else None


def test_latest_match_and_proposal_agree_with_a_plain_search():
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 40))]
        array = np.array(tokens + [99] * 5, dtype=np.int64)  # room beyond the length is never read
        for n in (1, 2, 3, 4):
            expected = _plain_latest_match(tokens, n) if len(tokens) > n else None
            assert latest_match(array, len(tokens), n) == expected, (tokens, n)
        count, low, high = rng.randint(1, 5), rng.randint(1, 2), rng.randint(2, 4)
        expected = []
        for n in range(high, low - 1, -1):
            start = _plain_latest_match(tokens, n) if len(tokens) > n else None
            if start is not None:
                expected = tokens[start + n:start + n + count]
                break
        assert ngram_proposal(array, len(tokens), count, low, high) == expected


def test_accepted_tokens_keep_drafts_while_they_match():
    assert accepted_tokens([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]  # all kept, and the token after them
    assert accepted_tokens([4, 9, 6, 7], [4, 5, 6]) == [4, 9]  # cut at the first that differs
    assert accepted_tokens([8, 5, 6, 7], [4, 5, 6]) == [8]
    assert accepted_tokens([3], []) == [3]


class _Sequence:
    """What the proposer reads of an engine request."""

    def __init__(self, tokens, pending=0):
        self.request_id, self.all_token_ids, self.num_pending = str(id(self)), list(tokens), pending
        self.num_tokens, self.num_computed_tokens = len(tokens) + pending, len(tokens) + pending - 1
        self.num_output_tokens, self.max_tokens = 0, 100
        self.grammar, self.stop_scheduling, self.draft_token_ids = None, False, []


def test_the_proposer_asks_for_the_tokens_only_when_it_will_look():
    from dovetail.config import SpeculativeConfig
    from dovetail.engine.speculative import IDLE_STEPS, NgramProposer

    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=1,
                               disable_by_batch_size=2)
    proposer = NgramProposer(config, max_model_len=1000)
    repeating, plain = _Sequence([1, 2, 3, 1, 2]), _Sequence([1, 2, 3, 4, 5])
    proposer.propose([repeating])
    assert repeating.draft_token_ids == [3, 1, 2] and proposer.wants_tokens()  # found: look again next step
    proposer.propose([plain])
    assert plain.draft_token_ids == [] and not proposer.wants_tokens()  # none found: rest a while
    waits = []
    for _ in range(IDLE_STEPS):
        proposer.propose([_Sequence([1, 2, 1], pending=1)])  # a token in flight: nothing to look at
        waits.append(proposer.wants_tokens())
    assert waits == [False] * (IDLE_STEPS - 1) + [True]
    crowd = [_Sequence([1, 2, 1]) for _ in range(3)]
    for _ in range(3):  # more than disable_by_batch_size: no drafts, and no step waits for them
        proposer.propose(crowd)
        assert not proposer.wants_tokens() and all(s.draft_token_ids == [] for s in crowd)
    proposer.propose(crowd[:2], num_waiting=1)
    assert not proposer.wants_tokens()
    proposer.propose(crowd[:2])
    assert crowd[0].draft_token_ids == [2, 1] and proposer.wants_tokens()


def test_short_proposals_are_filled_up_where_the_steps_replay_graphs():
    from dovetail.config import SpeculativeConfig
    from dovetail.engine.speculative import NgramProposer

    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=1)
    proposer = NgramProposer(config, max_model_len=1000)
    repeating, plain, last = _Sequence([1, 2, 3, 1, 2]), _Sequence([4, 5, 6, 7]), _Sequence([1, 2, 1])
    last.num_output_tokens, last.max_tokens = 9, 10  # its next token is its last: nothing proposed for it
    proposer.graph_batch = 4
    proposer.propose([repeating, plain, last])
    assert [s.draft_token_ids for s in (repeating, plain, last)] == [[3, 1, 2], [7, 7, 7], [1, 1, 1]]
    proposer.graph_batch = 2  # more sequences than the largest graph: proposals as they are
    proposer.propose([repeating, plain, last])
    assert [s.draft_token_ids for s in (repeating, plain, last)] == [[3, 1, 2], [], []]


def test_config_defaults_follow_vllm_and_bad_values_name_the_field():
    def lookup(**values):
        config = EngineArgs("m", speculative_config={"method": "ngram", "num_speculative_tokens": 2, **values})
        spec = config.create_engine_config().speculative.speculative_config
        return spec.prompt_lookup_min, spec.prompt_lookup_max

    assert lookup() == (5, 5)
    assert lookup(prompt_lookup_max=4) == (4, 4)
    assert lookup(prompt_lookup_min=2) == (2, 2)
    assert lookup(prompt_lookup_min=1, prompt_lookup_max=3) == (1, 3)
    bad = [({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
           ({"method": "ngram"}, "speculative_config.num_speculative_tokens: Field required"),
           ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
           ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min (4) must not exceed prompt_lookup_max (2)"),
           ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "speculative_config.draft_model")]
    for value, message in bad:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            EngineArgs("m", speculative_config=value).create_engine_config()


def test_the_cli_flag_takes_json():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    assert engine_kwargs(args)["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4}
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "ngram"])


def _run(llm: LLM, params: SamplingParams, prompts=PROMPTS):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.logprobs, c.finish_reason, c.text) for c in o.outputs] for o in outputs]


def _logprobs_close(ours, theirs, tol=1e-4) -> None:
    for ours_step, theirs_step in zip(ours or [], theirs or []):
        assert ours_step.keys() == theirs_step.keys()
        for token in ours_step:
            assert abs(ours_step[token].logprob - theirs_step[token].logprob) < tol


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), **COMMON), LLM(str(tiny_llama_dir), speculative_config=NGRAM, **COMMON)


class _KnowingProposer:
    """Proposes the reference continuation of each (prompt, sample index), with the token at ``wrong`` (counted
    from the request's next output token, when within the drafts) replaced: every draft is kept, or those up to
    it."""

    def __init__(self, references: dict[tuple, list[int]], count: int, wrong: int | None):
        self.references, self.count, self.wrong = references, count, wrong

    def wants_tokens(self):
        return True

    def propose(self, requests, allowed=True, num_waiting=0):
        for req in requests:
            req.draft_token_ids = []
            if req.num_tokens - req.num_computed_tokens != 1:
                continue
            done = req.num_output_tokens
            reference = self.references[(tuple(req.prompt_token_ids), req.index)]
            drafts = list(reference[done:done + min(self.count, req.max_tokens - done - 1)])
            if self.wrong is not None and self.wrong < len(drafts):
                drafts[self.wrong] = (drafts[self.wrong] + 1) % 300
            req.draft_token_ids = drafts


CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
    "seeded": SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=11, max_tokens=24, ignore_eos=True,
                             logprobs=1),
    "penalties": SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2,
                                max_tokens=24, ignore_eos=True),
    "min_tokens and EOS": SamplingParams(temperature=0, min_tokens=10, max_tokens=24),
    "stop string": SamplingParams(temperature=0, max_tokens=24, stop=["e"], ignore_eos=True),
    "n=2 seeded": SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=16, ignore_eos=True),
    "max_tokens under the drafts": SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_drafts_leave_the_outputs_as_plain_decoding_gives_them(engines, case):
    """With n-gram drafts, and with drafts that are the right continuation but for their third token."""
    plain, speculative = engines
    expected = _run(plain, CASES[case])
    ngram = speculative.llm_engine.proposer
    knowing = _KnowingProposer({(tuple(p), i): c[0] for p, out in zip(PROMPTS, expected) for i, c in enumerate(out)},
                               4, wrong=2)
    for proposer in (ngram, knowing):
        speculative.llm_engine.proposer = proposer
        before = speculative.llm_engine.stats()
        try:
            got = _run(speculative, CASES[case])
        finally:
            speculative.llm_engine.proposer = ngram
        for ours, theirs in zip(got, expected):
            for (tokens, logprobs, reason, text), (ref_tokens, ref_logprobs, ref_reason, ref_text) in zip(ours,
                                                                                                          theirs):
                assert (tokens, reason, text) == (ref_tokens, ref_reason, ref_text)
                _logprobs_close(logprobs, ref_logprobs)
        after = speculative.llm_engine.stats()
        if proposer is knowing and CASES[case].max_tokens > 3:
            assert after["spec_decode_num_accepted_tokens"] > before["spec_decode_num_accepted_tokens"]


@pytest.mark.parametrize("case", ["greedy", "seeded", "penalties"])
def test_overlapped_steps_wait_for_tokens_only_to_look_for_drafts(tiny_llama_dir, engines, case):
    """With steps overlapped (``async_scheduling``, the default on GPUs) a step waits for the one before only
    when the proposer looks for drafts, and after a step with drafts: the outputs stay those of plain decoding,
    and drafts are still found and accepted."""
    plain, _ = engines
    overlapped = LLM(str(tiny_llama_dir), async_scheduling=True, speculative_config=NGRAM, **COMMON)
    assert overlapped.llm_engine.overlap
    looks = []
    proposer = overlapped.llm_engine.proposer
    original = proposer.wants_tokens
    proposer.wants_tokens = lambda: looks.append(original()) or looks[-1]
    expected, got = _run(plain, CASES[case]), _run(overlapped, CASES[case])
    assert [[(t, r, x) for t, _, r, x in o] for o in got] == [[(t, r, x) for t, _, r, x in o] for o in expected]
    if case == "greedy":
        assert False in looks and True in looks
        assert overlapped.llm_engine.num_accepted_tokens > 0


def test_ngram_drafts_are_accepted_on_repeating_text(engines):
    _, speculative = engines
    before = speculative.llm_engine.stats()
    _run(speculative, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    after = speculative.llm_engine.stats()
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert 0 < accepted <= drafted


@pytest.mark.parametrize("wrong", [None, 0, 2])
def test_verification_keeps_the_right_drafts_and_matches_hf(tiny_llama_dir, tiny_llama_hf, wrong):
    max_tokens = 20
    references = {tuple(p): hf_greedy(tiny_llama_hf, p, max_tokens) for p in PROMPTS}
    llm = LLM(str(tiny_llama_dir), speculative_config=NGRAM, **COMMON)
    engine = llm.llm_engine
    engine.proposer = _KnowingProposer({(k, 0): v[0] for k, v in references.items()}, 4, wrong)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        tokens, hf_logprobs = references[tuple(prompt)]
        completion = out.outputs[0]
        assert_greedy_matches(completion.token_ids, tokens, hf_logprobs)
        for step, token in enumerate(completion.token_ids):
            assert abs(completion.logprobs[step][token].logprob - float(hf_logprobs[step][token])) < 1e-4
    stats = engine.stats()
    drafted, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    if wrong is None:
        assert accepted == drafted > 0
    else:
        assert 0 <= accepted < drafted
        if wrong == 2:
            assert accepted > 0


def test_preempted_requests_with_drafts_give_the_same_tokens(tiny_llama_dir):
    small = dict(COMMON, max_model_len=96, num_gpu_blocks_override=8, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(str(tiny_llama_dir), **small)
    speculative = LLM(str(tiny_llama_dir), speculative_config=NGRAM, **small)
    assert _run(speculative, params) == _run(plain, params)
    assert speculative.llm_engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("num_blocks", [2, 3])
def test_drafts_take_only_the_blocks_left_once_every_sequence_has_its_own(num_blocks):
    from dovetail.engine.kv_cache_manager import KVCacheManager
    from dovetail.engine.request import Request
    from dovetail.engine.scheduler import Scheduler

    config = EngineArgs("m", max_num_seqs=4, max_num_batched_tokens=64).create_engine_config()
    scheduler = Scheduler(config, KVCacheManager(num_blocks, block_size=4, enable_prefix_caching=False), 64)
    first, second = (Request(name, None, prompt, SamplingParams(max_tokens=10), set())
                     for name, prompt in (("a", [1, 2, 3]), ("b", [4, 5, 6])))
    scheduler.add(first)
    scheduler.add(second)
    batch = scheduler.schedule()  # both prompts, a block each
    for request, n in zip(batch.requests, batch.num_new_tokens):
        request.num_computed_tokens += n
        request.append_token(7)
    first.draft_token_ids = [8, 9]  # past its block: a third block
    batch = scheduler.schedule()
    scheduled = {r.request_id: n for r, n in zip(batch.requests, batch.num_new_tokens)}
    assert not batch.preempted
    if num_blocks == 2:  # no block left for the drafts: dropped, and both sequences decode
        assert scheduled == {"a": 1, "b": 1} and first.draft_token_ids == []
    else:
        assert scheduled == {"a": 3, "b": 1} and first.draft_token_ids == [8, 9]


def test_no_drafts_while_the_batch_is_larger_than_disable_by_batch_size(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    counts = {}
    for limit in (3, 4):
        llm = LLM(str(tiny_llama_dir), speculative_config=dict(NGRAM, disable_by_batch_size=limit), **COMMON)
        _run(llm, params)  # four sequences at once, all to the same length
        counts[limit] = llm.llm_engine.num_draft_tokens
    assert counts[3] == 0 < counts[4]


def test_pooling_models_refuse_speculation(tiny_llama_dir):
    with pytest.raises(ConfigError, match="speculative_config: speculative decoding runs on generating models"):
        LLM(str(tiny_llama_dir), runner="pooling", speculative_config=NGRAM, **COMMON)


def test_tensor_parallel_drafts_match_one_rank(tiny_llama_dir):
    from test_tp_engine import assert_ranks_agree

    params = SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True, logprobs=1)
    expected = _run(LLM(str(tiny_llama_dir), **COMMON), params)
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, speculative_config=NGRAM, **COMMON)
    llm.llm_engine.proposer = _KnowingProposer(
        {(tuple(p), 0): out[0][0] for p, out in zip(PROMPTS, expected)}, 4, wrong=2)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert_ranks_agree(llm, outputs)
        got = [[(c.token_ids, c.logprobs, c.finish_reason, c.text) for c in o.outputs] for o in outputs]
        for ours, theirs in zip(got, expected):
            assert ours[0][0] == theirs[0][0]
            _logprobs_close(ours[0][1], theirs[0][1])
        assert llm.llm_engine.stats()["spec_decode_num_accepted_tokens"] > 0
    finally:
        llm.llm_engine.shutdown()


def test_server_with_drafts_streams_what_plain_decoding_gives(tiny_llama_dir):
    """The shared server of the tiny Llama decodes speculatively (``--speculative-config``): over a real socket,
    the official client's streamed and whole completions equal the engine's without drafts, and ``/metrics``
    counts the drafts."""
    import httpx
    import openai
    from test_server_cli import API_KEY, MAIN_FLAGS, shared_server
    from test_server_openai import _metric

    assert "--speculative-config" in MAIN_FLAGS
    server = shared_server(tiny_llama_dir, *MAIN_FLAGS)
    prompts = [PROMPTS[0], PROMPTS[3]]
    plain = LLM(str(tiny_llama_dir), max_model_len=512)
    expected = [o.outputs[0].text for o in plain.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
        use_tqdm=False)]

    def counts():
        text = httpx.get(server.url("/metrics"), headers={"Authorization": f"Bearer {API_KEY}"}).text
        return (_metric(text, "dovetail_spec_decode_num_draft_tokens_total"),
                _metric(text, "dovetail_spec_decode_num_accepted_tokens_total"))

    before = counts()
    with openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0, timeout=120) as client:
        for prompt, text in zip(prompts, expected):
            whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=0,
                                              extra_body={"ignore_eos": True})
            assert whole.choices[0].text == text
            stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == text
    after = counts()
    assert 0 < after[1] - before[1] <= after[0] - before[0]


def test_steps_with_drafts_replay_their_graphs_and_match_hf(tiny_llama_dir, tiny_llama_hf):
    """Where the backend captures uniform batches, every sequence gets all its drafts (short proposals filled
    up) and the step replays a graph of its own: static buffers, padding sequences in the spare block."""
    from test_cuda_graph_runner import DeviceOnlyImpl, ReplayPlatform

    max_tokens = [24, 20, 13, 9]
    llm = LLM(str(tiny_llama_dir), max_num_seqs=6, speculative_config=NGRAM, **COMMON)
    engine = llm.llm_engine
    runner = engine.runner
    assert runner.verify_graphs is None, "the CPU platform captures no graphs"
    for layer in runner.attention_layers:
        layer.impl = DeviceOnlyImpl(layer.spec)
    runner.platform, runner.use_graphs = ReplayPlatform(), True
    runner.backend = type("UniformReference", (runner.backend,), {"supports_uniform_query_graphs": True})
    runner.capture_graphs()
    assert runner.verify_graphs.sizes == [1, 2, 4, 6] and runner.verify_graphs.q == NGRAM["num_speculative_tokens"] + 1
    engine.proposer.graph_batch = 6
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, n, out in zip(PROMPTS, max_tokens, outputs):
        tokens, hf_logprobs = hf_greedy(tiny_llama_hf, prompt, n)
        assert_greedy_matches(out.outputs[0].token_ids, tokens, hf_logprobs)
    replays = {size: graph.replays for size, graph in runner.verify_graphs.graphs.items()}
    assert sum(replays.values()) > 0, replays
    assert engine.num_accepted_tokens > 0
