"""Dual-batch overlap: where a step splits, the parts' turns at each pause, the backend's collectives while
parts are in flight, and the engine's tokens with steps split into micro-batches (one rank in process; the
two-rank run is in test_tp_engine.py)."""

from __future__ import annotations

import argparse

import pytest
import torch

from dovetail import LLM, SamplingParams
from dovetail.cli.engine_args import add_engine_arguments, engine_kwargs
from dovetail.distributed import parallel_state
from dovetail.engine.micro_batches import parts_share_blocks, run_interleaved, split_point
from dovetail.errors import ConfigError
from dovetail.forward_context import get_forward_context
from test_models_vs_hf import CASES, save_checkpoint
from tiny_models import assert_greedy_matches, hf_greedy, load_hf


@pytest.mark.parametrize("tokens, expected", [
    ([100, 100, 100, 100], 2),         # even halves
    ([1, 1, 1, 300, 200, 100], 4),     # decodes first, then prompts: 303 | 300
    ([50, 450, 500], 2),               # 500 | 500
    ([900, 50, 50], None),             # one long prompt: the smaller part would be a tenth
    ([300, 100], 1),                   # 300 | 100: a quarter is enough
    ([4000], None),                    # a single request never splits
    ([10, 10], None),                  # below the threshold
])
def test_a_step_splits_at_the_request_boundary_nearest_half_its_tokens(tokens, expected):
    assert split_point(tokens, min_tokens=100) == expected


def test_parts_that_read_a_block_the_other_part_writes_are_found():
    # request 0 computes its first 16 tokens (blocks 0, 1); request 1 starts at token 16 on them (a prefix hit)
    assert parts_share_blocks([0, 16], [16, 8], [[0, 1], [0, 1, 5]], block_size=8, split=1)
    # the other way round: the first part's decode reads block 4, which the second part's prompt writes
    assert parts_share_blocks([9, 0], [1, 16], [[4, 4], [3, 4]], block_size=8, split=1)
    # separate blocks; a decode and a chunked prompt reading only their own blocks
    assert not parts_share_blocks([0, 0], [16, 16], [[0, 1], [2, 3]], block_size=8, split=1)
    assert not parts_share_blocks([20, 8, 0], [1, 8, 10], [[6, 7, 8], [2, 3], [0, 1]], block_size=8, split=2)


def test_the_parts_take_turns_from_pause_to_pause_each_under_its_own_metadata():
    events = []

    def forward_steps(input_ids, positions):
        name = get_forward_context().attn_metadata
        for pause in range(3):
            events.append((name, pause, get_forward_context().attn_metadata))
            yield
        events.append((name, "end", get_forward_context().attn_metadata))
        return input_ids + positions

    ids = torch.arange(4)
    first, second = run_interleaved(forward_steps, [(ids, ids, "A"), (ids * 10, ids, "B")], side_stream=None)
    assert [(name, pause) for name, pause, _ in events] == [
        ("A", 0), ("B", 0), ("A", 1), ("B", 1), ("A", 2), ("B", 2), ("A", "end"), ("B", "end")]
    assert all(name == seen for name, _, seen in events), "each part runs under its own attention metadata"
    assert torch.equal(first, ids * 2) and torch.equal(second, ids * 11)


def test_collectives_go_through_the_backend_while_parts_are_in_flight(monkeypatch):
    taken, by_backend = [], []

    def kernel(tensor):
        taken.append(tensor)
        return True

    monkeypatch.setattr(parallel_state, "_size", 2)
    monkeypatch.setattr(parallel_state.dist, "all_reduce", lambda tensor, group=None: by_backend.append(tensor))
    parallel_state.set_all_reduce_kernel(kernel)
    try:
        x = torch.ones(3)
        parallel_state.all_reduce(x)
        assert len(taken) == 1 and not by_backend
        with parallel_state.backend_collectives():
            parallel_state.all_reduce(x)
        assert len(taken) == 1 and len(by_backend) == 1
        parallel_state.all_reduce(x)
        assert len(taken) == 2, "the platform's kernel is back once the parts are done"
    finally:
        parallel_state.set_all_reduce_kernel(None)


PROMPTS = [list(range(3, 40)), list(range(50, 75)), [7, 8, 9] * 10, list(range(90, 131))]
#: Chunked prefills of 48 tokens a step beside decodes, on the CPU.
CHUNKED = dict(device="cpu", attention_backend="REFERENCE", dtype="float32", max_model_len=128,
               max_num_batched_tokens=48, enable_chunked_prefill=True)


@pytest.mark.parametrize("case", ["llama-tied-head_dim-bias", "gemma2-softcap-sliding",
                                  "qwen3moe-normtopk-dense-layer"])
def test_steps_split_into_micro_batches_give_hfs_tokens(case, tmp_path):
    """Chunked prefills beside decodes, split at every step of 16 tokens or more (Gemma 2's sandwich norms and
    a mixture of experts included): the same greedy tokens as HF and as whole steps."""
    path = save_checkpoint(tmp_path, CASES[case]())
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    split = LLM(str(path), enable_dbo=True, dbo_prefill_token_threshold=16, **CHUNKED)
    ours = [o.outputs[0].token_ids for o in split.generate(prompts, params, use_tqdm=False)]
    assert split.llm_engine.executor.worker.describe()["micro_batched_steps"] > 0
    whole = LLM(str(path), enable_dbo=False, **CHUNKED)
    assert whole.llm_engine.executor.worker.runner.micro_batch_tokens is None
    theirs = [o.outputs[0].token_ids for o in whole.generate(prompts, params, use_tqdm=False)]
    hf = load_hf(path)
    for mine, unsplit, prompt in zip(ours, theirs, PROMPTS):
        tokens, logprobs = hf_greedy(hf, prompt, 8)
        assert_greedy_matches(mine, tokens, logprobs)
        assert mine == unsplit


def test_a_step_whose_prompts_share_a_prefix_computed_in_it_runs_whole(tiny_llama_dir):
    """The second prompt's prefix-cache hit is on blocks the first prompt writes in the same step: split, the
    second part could read them before the first part's stream has written them."""
    common = dict(device="cpu", attention_backend="REFERENCE", dtype="float32", max_model_len=128, block_size=8,
                  enable_dbo=True, dbo_prefill_token_threshold=8)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    shared = list(range(10, 42))
    for prompts, split in (([shared + [1, 2, 3], shared + list(range(100, 116))], False),
                           ([shared + [1, 2, 3], list(range(60, 94))], True)):
        llm = LLM(str(tiny_llama_dir), **common)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert (llm.llm_engine.executor.worker.runner.micro_batched_steps > 0) == split
        if not split:
            assert llm.llm_engine.kv_manager.prefix_hits > 0


@pytest.mark.parametrize("why", ["planning backend", "model without pauses"])
def test_steps_stay_whole_where_the_backend_or_the_model_cannot_split_them(why, tiny_llama_dir, monkeypatch, caplog):
    from dovetail.attention.backend import AttentionMetadataBuilder
    from dovetail_models.llama import LlamaForCausalLM

    if why == "planning backend":
        monkeypatch.setattr(AttentionMetadataBuilder, "independent_builds", False)
    else:
        monkeypatch.setattr(LlamaForCausalLM, "forward_steps", None)
    with caplog.at_level("INFO", logger="dovetail"):
        llm = LLM(str(tiny_llama_dir), device="cpu", attention_backend="REFERENCE", dtype="float32",
                  max_model_len=64, enable_dbo=True, dbo_prefill_token_threshold=8)
    assert llm.llm_engine.executor.worker.runner.micro_batch_tokens is None
    assert "dual-batch overlap off: " + ("the REFERENCE attention backend plans" if why == "planning backend"
                                         else "LlamaForCausalLM has no forward_steps") in caplog.text
    prompts = [{"prompt_token_ids": list(range(3, 20))}, {"prompt_token_ids": list(range(30, 47))}]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert llm.llm_engine.executor.worker.runner.micro_batched_steps == 0


def test_a_plugins_decoder_layer_without_pauses_runs_whole_between_the_parts_turns(tiny_llama_dir, monkeypatch):
    """``LlamaModel.forward_steps`` over a layer class that has no ``forward_steps`` of its own (a plugin's):
    the layer runs whole, then the parts change turns; the tokens are those of whole steps."""
    from dovetail.model_interface import run_to_end
    from dovetail_models.llama import LlamaDecoderLayer, LlamaModel

    class LayerWithoutPauses(LlamaDecoderLayer):
        forward_steps = None

        def forward(self, positions, hidden_states, residual):
            return run_to_end(LlamaDecoderLayer.forward_steps(self, positions, hidden_states, residual))

    monkeypatch.setattr(LlamaModel, "layer_cls", LayerWithoutPauses)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    split = LLM(str(tiny_llama_dir), enable_dbo=True, dbo_prefill_token_threshold=16, **CHUNKED)
    layers = split.llm_engine.executor.worker.runner.model.model.layers
    assert all(type(layer) is LayerWithoutPauses for layer in layers)
    ours = [o.outputs[0].token_ids for o in split.generate(prompts, params, use_tqdm=False)]
    assert split.llm_engine.executor.worker.runner.micro_batched_steps > 0
    whole = LLM(str(tiny_llama_dir), enable_dbo=False, **CHUNKED)
    assert ours == [o.outputs[0].token_ids for o in whole.generate(prompts, params, use_tqdm=False)]


def test_dual_batch_overlap_is_off_by_default_and_the_flags_turn_it_on(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", attention_backend="REFERENCE", dtype="float32",
              max_model_len=64)
    assert llm.llm_engine.config.parallel.enable_dbo is False
    assert llm.llm_engine.executor.worker.runner.micro_batch_tokens is None
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_kwargs(parser.parse_args(["--enable-dbo", "--dbo-prefill-token-threshold", "4096"])) == {
        "enable_dbo": True, "dbo_prefill_token_threshold": 4096}
    assert engine_kwargs(parser.parse_args(["--enable-dbo", "false"])) == {"enable_dbo": False}
    with pytest.raises(ConfigError, match="dbo_prefill_token_threshold"):
        LLM(str(tiny_llama_dir), device="cpu", dbo_prefill_token_threshold=1)
