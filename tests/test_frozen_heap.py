"""The long-lived heap leaves the garbage collector's full passes while an engine generates, and comes back after."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from dovetail import LLM, SamplingParams
from dovetail.engine.async_engine import AsyncLLMEngine, NewRequest
from dovetail.engine.frozen_heap import frozen_heap, is_frozen

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def _tracked(obj) -> bool:
    """Whether the collector's generations hold ``obj`` (a frozen object is in none of them)."""
    return any(o is obj for o in gc.get_objects())


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), device="cpu", max_model_len=64, max_num_seqs=4)


def _spy_on_steps(engine, sentinel) -> list[tuple[bool, bool]]:
    """Record, at each engine step, whether the heap is frozen and whether ``sentinel`` is still collected."""
    seen, step = [], engine.step

    def spying_step():
        seen.append((is_frozen(), _tracked(sentinel)))
        return step()

    engine.step = spying_step
    return seen


def test_generate_freezes_the_heap_for_its_steps_only(llm):
    built_before = ["a container the collector tracks"]
    seen = _spy_on_steps(llm.llm_engine, built_before)
    try:
        out = llm.generate([[1, 2, 3], [4, 5]], GREEDY, use_tqdm=False)
    finally:
        del llm.llm_engine.step
    assert [len(o.outputs[0].token_ids) for o in out] == [3, 3]
    assert seen and all(frozen and not tracked for frozen, tracked in seen)
    assert not is_frozen() and _tracked(built_before)


def test_an_engine_dropped_in_a_cycle_after_generating_is_collected(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64, max_num_seqs=4)
    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    engine = weakref.ref(llm.llm_engine)
    llm.llm_engine.itself = llm.llm_engine  # a cycle: only the collector frees it
    del llm
    gc.collect()
    assert engine() is None


def test_the_server_engine_thread_keeps_the_heap_frozen_while_it_runs(llm):
    built_before = ["a container the collector tracks"]

    async def main():
        engine = AsyncLLMEngine(llm.llm_engine)
        engine.start()
        try:
            stream = await engine.add([NewRequest("r0", {"prompt_token_ids": [1, 2, 3]}, GREEDY)])
            async for _ in stream:
                pass
            return is_frozen(), _tracked(built_before)
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == (True, False)
    assert not is_frozen() and _tracked(built_before)


def test_nested_blocks_leave_the_outer_freeze_in_place():
    with frozen_heap():
        with frozen_heap():
            assert is_frozen()
        assert is_frozen() and gc.get_freeze_count() > 0
    assert not is_frozen() and gc.get_freeze_count() == 0
