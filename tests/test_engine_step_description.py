"""The step description the engine hands its workers: a request in full once, then only its new blocks;
forgotten when it finishes or is preempted (and sent in full again); plain data that pickles; a token bitmask
that reaches the sampler."""

from __future__ import annotations

import pickle

import pytest
import torch

from dovetail import LLM, SamplingParams
from dovetail.engine.step import StepDescription, apply_token_bitmask

COMMON = dict(device="cpu", attention_backend="REFERENCE", dtype="float32", max_model_len=128, block_size=8)


def _recording(llm: LLM) -> list[StepDescription]:
    engine, steps = llm.llm_engine, []
    describe = engine.describe_step

    def record(batch):
        step = describe(batch)
        steps.append(pickle.loads(pickle.dumps(step)))  # what a worker process would receive
        return step

    engine.describe_step = record
    return steps


def test_new_requests_once_in_full_then_only_new_blocks(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), **COMMON)
    steps = _recording(llm)
    prompts = [{"prompt_token_ids": list(range(10, 22))}, {"prompt_token_ids": [5, 6, 7]}]
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    first = steps[0]
    assert [r.request_id for r in first.new_requests] == ["llm-0", "llm-1"] == sorted(first.request_ids)
    new = {r.request_id: r for r in first.new_requests}
    assert new["llm-0"].prompt_token_ids == list(range(10, 22)) and new["llm-0"].block_ids == [0, 1]
    assert new["llm-0"].output_token_ids == [] and new["llm-0"].num_computed_tokens == 0
    assert new["llm-0"].params.max_tokens == 10 and 1 in new["llm-0"].eos_token_ids
    assert all(not s.new_requests for s in steps[1:])
    # llm-0 reaches 16 tokens (2 blocks) at its 4th output token and 24 at its 12th; llm-1 reaches 8 at its 5th.
    grown = [(i, rid, blocks) for i, s in enumerate(steps) for rid, blocks in s.new_block_ids.items()]
    assert [(rid, len(blocks)) for _, rid, blocks in grown] == [("llm-0", 1), ("llm-1", 1)]
    assert sum(len(s.request_ids) for s in steps) == 2 + 2 * 9  # one prefill and nine decodes each
    assert all(o.finished and len(o.outputs[0].token_ids) == 10 for o in out)
    llm.generate({"prompt_token_ids": [9, 9]}, SamplingParams(max_tokens=1), use_tqdm=False)
    assert sorted(steps[-1].finished_request_ids) == ["llm-0", "llm-1"], "finished requests are forgotten"


def test_preempted_requests_are_forgotten_and_sent_again_in_full(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_gpu_blocks_override=16, max_num_seqs=4, **COMMON)
    steps = _recording(llm)
    prompts = [{"prompt_token_ids": list(range(10 + i, 60 + i))} for i in range(3)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    resent = [(i, r) for i, s in enumerate(steps) for r in s.new_requests if r.output_token_ids]
    assert resent, "a preempted request comes back with the tokens it had generated"
    for i, data in resent:
        assert any(data.request_id in s.finished_request_ids for s in steps[:i + 1])
        assert data.num_computed_tokens % 8 == 0 and len(data.prompt_token_ids) == 50


def test_apply_token_bitmask_keeps_exactly_the_allowed_tokens():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 70, generator=gen)
    allowed = torch.rand(3, 70, generator=gen) < 0.3
    allowed[2] = True
    words = torch.zeros(3, 3, dtype=torch.int64)
    for row, token in allowed.nonzero().tolist():
        words[row, token // 32] |= 1 << (token % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # int32 words, as xgrammar packs
    masked = logits.clone()
    apply_token_bitmask(masked, bitmask)  # 70 tokens: the last word is partly past the vocabulary
    torch.testing.assert_close(masked, logits.masked_fill(~allowed, float("-inf")))
    some = logits.clone()
    apply_token_bitmask(some, bitmask[[0, 1]], rows=[2, 0])  # bitmask rows constrain logits rows 2 and 0
    expected = logits.clone()
    expected[2] = logits[2].masked_fill(~allowed[0], float("-inf"))
    expected[0] = logits[0].masked_fill(~allowed[1], float("-inf"))
    torch.testing.assert_close(some, expected)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_token_bitmask_constrains_what_the_workers_sample(tiny_llama_dir, async_scheduling):
    llm = LLM(str(tiny_llama_dir), async_scheduling=async_scheduling, **COMMON)
    engine = llm.llm_engine
    describe = engine.describe_step
    only = (17, 250)

    def constrained(batch):
        step = describe(batch)
        rows = sum(1 for r, n in zip(batch.requests, batch.num_new_tokens) if r.num_computed_tokens + n == r.num_tokens)
        mask = torch.zeros(rows, -(-engine.vocab_size // 32), dtype=torch.int32)
        for token in only:
            mask[:, token // 32] |= 1 << (token % 32)
        step.token_bitmask = mask
        return step

    engine.describe_step = constrained
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": list(range(30, 50))}],
                       SamplingParams(temperature=1.0, seed=1, max_tokens=12, ignore_eos=True), use_tqdm=False)
    tokens = [t for o in out for t in o.outputs[0].token_ids]
    assert set(tokens) <= set(only) and len(tokens) == 24


@pytest.mark.parametrize("rows", [None, [2, 0]], ids=["every-row", "some-rows"])
def test_apply_token_bitmask_touches_only_the_constrained_rows_and_nothing_beyond(rows):
    """70 tokens: the last word of each row has bits past the vocabulary, which must not be written."""
    gen = torch.Generator().manual_seed(1)
    storage = torch.zeros(500)
    logits = storage[100:310].view(3, 70)
    logits.copy_(torch.randn(3, 70, generator=gen))
    before = logits.clone()
    chosen = rows or [0, 1, 2]
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(chosen), 3), dtype=torch.int32, generator=gen)
    bitmask[:, 2] &= 0x3F  # the tokens past 70 are not allowed, as xgrammar fills them
    bitmask[chosen.index(2)] = torch.tensor([-1, -1, 0x3F], dtype=torch.int32)  # the last row: every token
    apply_token_bitmask(logits, bitmask, rows)
    assert not storage[:100].any() and not storage[310:].any()
    bits = ((bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten(1)[:, :70].bool()
    expected = before.clone()
    for i, row in enumerate(chosen):
        expected[row] = before[row].masked_fill(~bits[i], float("-inf"))
    torch.testing.assert_close(logits, expected)
