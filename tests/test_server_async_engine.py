"""AsyncLLMEngine: one engine loop for many coroutines; failures stay with the requests they hit."""

from __future__ import annotations

import asyncio

import pytest

from dovetail import SamplingParams
from dovetail.engine.async_engine import (AsyncLLMEngine, EngineStepError, EngineStoppedError, NewRequest,
                                          QueueFullError)
from dovetail.errors import RequestError

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    from dovetail import LLM

    return LLM(str(tiny_llama_dir), max_model_len=256, max_num_seqs=4)


def run(llm, scenario, max_waiting_requests=None):
    """Run ``scenario(engine)`` on a fresh engine loop over ``llm``'s engine, then stop the loop."""
    async def main():
        engine = AsyncLLMEngine(llm.llm_engine, max_waiting_requests=max_waiting_requests)
        engine.start()
        try:
            return await scenario(engine)
        finally:
            await engine.shutdown()
            assert not engine.is_running

    return asyncio.run(main())


async def _final(stream):
    final = None
    async for item in stream:
        final = item.output
    return final


def test_concurrent_requests_match_offline_generation(llm):
    prompts = [[5, 6, 7], [40, 41], list(range(100, 120)), [7] * 9, [250, 3]]
    expected = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                                             use_tqdm=False)]

    async def scenario(engine):
        streams = [await engine.add([NewRequest(f"r{i}", {"prompt_token_ids": p}, GREEDY)])
                   for i, p in enumerate(prompts)]
        return await asyncio.gather(*(_final(s) for s in streams))

    outputs = run(llm, scenario)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.finished for o in outputs)


def test_deltas_add_up_to_the_final_output(llm):
    async def scenario(engine):
        stream = await engine.add([NewRequest("d", "hello world", SamplingParams(max_tokens=12, seed=3, n=2))])
        texts, ids, final = ["", ""], [[], []], None
        async for item in stream:
            for i, (text, new_ids) in enumerate(item.output.deltas):
                texts[i] += text
                ids[i] += new_ids
            final = item.output
        return texts, ids, final

    texts, ids, final = run(llm, scenario)
    assert texts == [c.text for c in final.outputs]
    assert ids == [c.token_ids for c in final.outputs]


def test_a_slow_consumer_gets_the_missed_steps_merged(llm):
    async def scenario(engine):
        stream = await engine.add([NewRequest("slow", "hello world", SamplingParams(max_tokens=20, seed=5, n=2,
                                                                                     ignore_eos=True))])
        # A command's answer reaches the event loop after the outputs of the steps before it.
        while await engine.call(lambda e: e.num_unfinished_requests()):
            await asyncio.sleep(0.01)
        return [item async for item in stream]

    items = run(llm, scenario)
    assert len(items) == 1 and items[0].output.finished  # twenty steps, one merged output
    for (text, ids), completion in zip(items[0].output.deltas, items[0].output.outputs):
        assert text == completion.text and ids == completion.token_ids and len(ids) == 20


def test_invalid_group_is_added_not_at_all(llm):
    async def scenario(engine):
        requests = [NewRequest("ok", [5, 6], GREEDY), NewRequest("bad", [5, 10**6], GREEDY)]
        with pytest.raises(RequestError) as info:
            await engine.add(requests)
        assert info.value.field == "prompt_token_ids"
        return await engine.call(lambda e: e.num_unfinished_requests())

    assert run(llm, scenario) == 0


def test_abort_frees_blocks_before_the_next_step(llm):
    async def scenario(engine):
        stream = await engine.add([NewRequest("long", [5, 6], SamplingParams(max_tokens=200, ignore_eos=True))])
        iterator = stream.__aiter__()
        await iterator.__anext__()
        used = await engine.call(lambda e: e.stats()["kv_cache_usage"])
        stream.abort()
        after = await engine.call(lambda e: (e.stats()["kv_cache_usage"], e.num_unfinished_requests()))
        return used, after

    used, (usage, unfinished) = run(llm, scenario)
    assert used > 0
    assert usage == 0.0 and unfinished == 0


def test_a_failing_step_fails_only_the_requests_in_flight_and_the_loop_goes_on(llm, monkeypatch):
    engine_core = llm.llm_engine
    real_step = engine_core.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected fault")
        return real_step()

    monkeypatch.setattr(engine_core, "step", flaky_step)

    async def scenario(engine):
        victim = await engine.add([NewRequest("victim", [5, 6], GREEDY)])
        with pytest.raises(EngineStepError, match="injected fault"):
            await _final(victim)
        later = await engine.add([NewRequest("later", [5, 6], GREEDY)])
        return await _final(later), engine.num_step_errors, await engine.call(lambda e: e.stats())

    output, errors, stats = run(llm, scenario)
    assert output.finished and len(output.outputs[0].token_ids) == 6
    assert errors == 1
    assert stats["kv_cache_usage"] == 0.0 and stats["running"] == 0


def test_waiting_queue_limit_counts_sequences(llm):
    long = SamplingParams(max_tokens=50, ignore_eos=True)

    async def scenario(engine):
        # max_num_seqs is 4 and at most 4 sequences may wait: four of a first request run once a step has
        # taken them, three of a second then wait, and two more would make five waiting.
        first = await engine.add([NewRequest("running", [5, 6], long.model_copy(update={"n": 4}))])
        await first.__aiter__().__anext__()  # a step ran: the four sequences are running, none waits
        await engine.add([NewRequest("waiting", [5, 6], long.model_copy(update={"n": 3}))])
        with pytest.raises(QueueFullError, match="3 sequences waiting, 2 more asked for, max_waiting_requests=4"):
            await engine.add([NewRequest("two-more", [5, 6], GREEDY.model_copy(update={"n": 2}))])
        with pytest.raises(QueueFullError, match="the request makes 5 sequences, more than may ever wait"):
            await engine.add([NewRequest("never-fits", [5, 6], GREEDY.model_copy(update={"n": 5}))])
        first.abort()
        return await _final(await engine.add([NewRequest("after", [5, 6], GREEDY)]))

    assert run(llm, scenario, max_waiting_requests=4).finished


def test_abort_all_and_stopped_engine(llm):
    async def scenario(engine):
        stream = await engine.add([NewRequest("s", [5, 6], SamplingParams(max_tokens=200, ignore_eos=True))])
        engine.stop_accepting()
        with pytest.raises(EngineStoppedError):
            await engine.add([NewRequest("refused", [5, 6], GREEDY)])
        engine.abort_all()
        with pytest.raises(EngineStoppedError):
            await _final(stream)
        return engine.engine.num_unfinished_requests()

    assert run(llm, scenario) == 0
