"""The decode-graph seam of the model runner, on the CPU: static buffers, padding, replay.

A stand-in platform "captures" by remembering the forward and "replays" by
running it again into the captured output, and a stand-in attention reads only
the batch's device tensors on decode steps (as a captured kernel would), so a
wrong buffer update, padding row or spare-block slot changes the tokens.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from dovetail import LLM, SamplingParams
from dovetail.cli.engine_args import add_engine_arguments, engine_kwargs
from dovetail.config import EngineArgs
from dovetail.errors import ConfigError
from dovetail.attention.reference import ReferenceAttentionImpl, attend, gather_kv
from dovetail.engine.model_runner import graph_batch_sizes
from dovetail.platform import DeviceGraph
from dovetail_cpu.platform import CpuPlatform
from tiny_models import assert_greedy_matches, hf_greedy

PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 61)), [3], list(range(100, 117)), [42] * 33]
MAX_TOKENS = [24, 20, 13, 9, 5]  # the decode batch shrinks 5 -> 4 -> 3 -> 2 -> 1: padded to 6, 4, 4, 2, 1


class ReplayGraph(DeviceGraph):
    def __init__(self, fn):
        self.fn, self.replays = fn, 0

    def replay(self):
        self.replays += 1
        self.fn()


class ReplayPlatform(CpuPlatform):
    """The CPU platform, with graphs that re-run their forward."""

    supports_graph_capture = True

    def capture_graph(self, fn, pool=None):
        out = fn()
        return ReplayGraph(fn), out


class DeviceOnlyImpl(ReferenceAttentionImpl):
    """Decode-only batches, and batches whose sequences all compute the same number of tokens (a speculative
    step's graph), read nothing from the host: whole block-table rows, masked by seq_lens."""

    def forward(self, q, k, v, kv_cache, metadata):
        width = metadata.max_query_len
        uniform = metadata.num_decodes == 0 and metadata.num_tokens == metadata.num_seqs * width
        if metadata.num_decodes != metadata.num_seqs and not uniform:
            return super().forward(q, k, v, kv_cache, metadata)
        heads, size = kv_cache.shape[-2], kv_cache.shape[-1]
        kv_cache[0].view(-1, heads, size).index_copy_(0, metadata.slot_mapping, k)
        kv_cache[1].view(-1, heads, size).index_copy_(0, metadata.slot_mapping, v)
        keys, values = gather_kv(kv_cache, metadata.block_table, metadata.block_table.shape[1])
        k_len = metadata.seq_lens.long()
        q_pos = (k_len - width).view(-1, 1) + torch.arange(width).view(1, -1)
        out = attend(q.view(metadata.num_seqs, width, *q.shape[1:]), keys, values, q_pos, k_len, self.spec)
        return out.reshape(q.shape).to(q.dtype)


def test_graph_batch_sizes_default_to_vllms_list():
    sizes = graph_batch_sizes(1024)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 512
    assert [b - a for a, b in zip(sizes[3:], sizes[4:])] == [8] * 31 + [16] * 16  # every 8 to 256, then 16
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert graph_batch_sizes(300)[-3:] == [272, 288, 300]
    assert graph_batch_sizes(1024, max_capture_size=20) == [1, 2, 4, 8, 16, 20]


def test_graph_batch_sizes_from_a_list():
    assert graph_batch_sizes(256, [64, 2, 16, 2]) == [2, 16, 64]
    assert graph_batch_sizes(8, [4, 16]) == [4], "sizes above the largest batch are dropped"
    assert graph_batch_sizes(256, [4, 128], max_capture_size=64) == [4]


@pytest.mark.parametrize("sizes", [[], [0, 4], [-2]])
def test_capture_sizes_must_be_positive(tiny_llama_dir, sizes):
    with pytest.raises(ConfigError, match="cudagraph_capture_sizes"):
        LLM(str(tiny_llama_dir), device="cpu", cudagraph_capture_sizes=sizes)


def test_capture_sizes_flag_reaches_the_engine():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--cudagraph-capture-sizes", "1", "8", "32", "--max-cudagraph-capture-size", "16"])
    kwargs = engine_kwargs(args)
    assert kwargs["cudagraph_capture_sizes"] == [1, 8, 32] and kwargs["max_cudagraph_capture_size"] == 16
    device = EngineArgs("m", **kwargs).create_engine_config().device
    assert device.cudagraph_capture_sizes == [1, 8, 32] and device.max_cudagraph_capture_size == 16


@pytest.fixture(scope="module")
def hf_reference(tiny_llama_hf):
    return [hf_greedy(tiny_llama_hf, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]


def test_replayed_decode_steps_match_hf(tiny_llama_dir, hf_reference):
    llm = LLM(str(tiny_llama_dir), device="cpu", attention_backend="REFERENCE", max_num_seqs=6)
    runner = llm.llm_engine.runner
    assert runner.graphs is None, "the CPU platform captures no graphs"  # pinned: a GPU host would pick cuda, and bf16
    for layer in runner.attention_layers:
        layer.impl = DeviceOnlyImpl(layer.spec)
    runner.platform, runner.use_graphs = ReplayPlatform(), True
    runner.capture_graphs()
    assert runner.graphs.sizes == [1, 2, 4, 6]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for out, (tokens, logprobs) in zip(outputs, hf_reference):
        assert_greedy_matches(out.outputs[0].token_ids, tokens, logprobs)
    replays = {size: graph.replays for size, graph in runner.graphs.graphs.items()}
    assert replays[6] > 0 and replays[4] > 0 and replays[1] > 0, replays
    # The padding rows wrote only to the spare block, which no sequence owns.
    assert runner.spare_block == llm.llm_engine.num_blocks


def replaying_engine(path, **kwargs):
    llm = LLM(str(path), device="cpu", attention_backend="REFERENCE", max_num_seqs=6, **kwargs)
    runner = llm.llm_engine.runner
    for layer in runner.attention_layers:
        layer.impl = DeviceOnlyImpl(layer.spec)
    runner.platform, runner.use_graphs = ReplayPlatform(), True
    runner.capture_graphs()
    return llm


def test_replayed_steps_read_their_inputs_from_the_step_in_flight(tiny_llama_dir, hf_reference, monkeypatch):
    """With overlapped scheduling a step's inputs are the step in flight's sampled tokens, still on the device;
    a token budget that leaves sequences out of some steps puts them in other rows there than in the step."""
    from dovetail.engine.model_runner import DecodeGraphs

    llm = replaying_engine(tiny_llama_dir, max_num_batched_tokens=8, async_scheduling=True)
    moved = []
    load = DecodeGraphs._load

    def spy(self, requests, block_tables, size, pending=([], []), prev_tokens=None):
        if pending[0] != pending[1]:
            moved.append(pending)
        return load(self, requests, block_tables, size, pending, prev_tokens)

    monkeypatch.setattr(DecodeGraphs, "_load", spy)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for out, (tokens, logprobs) in zip(outputs, hf_reference):
        assert_greedy_matches(out.outputs[0].token_ids, tokens, logprobs)
    assert moved, "no graph step read a pending token from another row"


@pytest.mark.parametrize("dst, src", [([0, 2], [3, 1]), ([0, 1, 2], [2, 0, 3]), ([], [])])
def test_a_graph_step_takes_host_inputs_and_pending_ones_each_from_its_place(tiny_llama_dir, dst, src):
    """Rows ``dst`` of the step read row ``src`` of the tokens in flight; the others their host token; padding
    rows token 0. The block tables and slots come in the same copy."""
    runner = replaying_engine(tiny_llama_dir).llm_engine.runner
    graphs, bs, spare = runner.graphs, runner.block_size, runner.spare_block
    contexts = (5, 9, 3)
    requests = [SimpleNamespace(num_computed_tokens=c, all_token_ids=list(range(100, 101 + c))) for c in contexts]
    in_flight = torch.tensor([70, 71, 72, 73])
    with torch.inference_mode():  # as the runner's steps run
        graphs._load(requests, [[1], [2], [3]], 4, (dst, src), in_flight)
    expected = [100 + c for c in contexts] + [0]
    for row, source in zip(dst, src):
        expected[row] = int(in_flight[source])
    ids, positions, slots = graphs._inputs(4).tolist()
    assert ids == expected and positions == [*contexts, 0]
    assert graphs.block_table[:4, 0].tolist() == [1, 2, 3, spare]
    assert slots == [block * bs + c for block, c in zip((1, 2, 3), contexts)] + [spare * bs]


def test_steps_above_the_largest_captured_size_run_eagerly(tiny_llama_dir, hf_reference):
    llm = LLM(str(tiny_llama_dir), device="cpu", attention_backend="REFERENCE", max_num_seqs=6,
              cudagraph_capture_sizes=[2, 3])
    runner = llm.llm_engine.runner
    for layer in runner.attention_layers:
        layer.impl = DeviceOnlyImpl(layer.spec)
    runner.platform, runner.use_graphs = ReplayPlatform(), True
    runner.capture_graphs()
    assert runner.graphs.sizes == [2, 3]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for out, (tokens, logprobs) in zip(outputs, hf_reference):
        assert_greedy_matches(out.outputs[0].token_ids, tokens, logprobs)
    replays = {size: graph.replays for size, graph in runner.graphs.graphs.items()}
    # Steps of 5 and 4 sequences decode eagerly; 3 sequences replay size 3; 2 and 1 (padded up) size 2.
    assert replays[3] == MAX_TOKENS[2] - MAX_TOKENS[3] and replays[2] == MAX_TOKENS[0] - MAX_TOKENS[2], replays


def replayed_tp_job(path: str, graphs: bool) -> dict:
    """On each rank of two: greedy and seeded sampled tokens (with logprobs) of an engine whose decode steps
    replay graphs (or run eagerly), the decode attention reading only device tensors in both."""
    llm = LLM(path, device="cpu", attention_backend="REFERENCE", max_num_seqs=6)
    runner = llm.llm_engine.runner
    for layer in runner.attention_layers:
        layer.impl = DeviceOnlyImpl(layer.spec)
    if graphs:
        runner.platform, runner.use_graphs = ReplayPlatform(), True
        runner.capture_graphs()
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    sampled = [SamplingParams(temperature=0.9, seed=i, max_tokens=n, logprobs=2, ignore_eos=True)
               for i, n in enumerate(MAX_TOKENS)]
    out_greedy = llm.generate(prompts, greedy, use_tqdm=False)
    out_sampled = llm.generate(prompts, sampled, use_tqdm=False)
    return {"greedy": [o.outputs[0].token_ids for o in out_greedy],
            "sampled": [o.outputs[0].token_ids for o in out_sampled],
            "logprobs": [[sorted((token, lp.logprob) for token, lp in step.items()) for step in o.outputs[0].logprobs]
                         for o in out_sampled],
            "sharded": runner.sharded_head is not None,
            "replays": sum(g.replays for g in runner.graphs.graphs.values()) if graphs else 0}


def test_replayed_decode_steps_at_two_ranks_sample_from_vocabulary_shards(tp_ranks, tiny_llama_dir, hf_reference):
    """At TP=2 the graphs keep each rank's vocabulary columns and compute the greedy tokens from them (no
    gather of the logits); sampled rows gather the columns after the replay. Both give the eager steps'
    tokens and logprobs, and the greedy ones HF's."""
    group = tp_ranks(2)
    replayed = group.run(replayed_tp_job, str(tiny_llama_dir), True)
    eager = group.run(replayed_tp_job, str(tiny_llama_dir), False)
    for rank in range(2):
        assert replayed[rank]["sharded"] and replayed[rank]["replays"] > 0
        assert replayed[rank]["greedy"] == eager[rank]["greedy"]
        assert replayed[rank]["sampled"] == eager[rank]["sampled"]
        for ours, theirs in zip(replayed[rank]["logprobs"], eager[rank]["logprobs"]):
            # The same tokens; values within float32 rounding (a padded batch's GEMM sums in another order).
            assert [[t for t, _ in step] for step in ours] == [[t for t, _ in step] for step in theirs]
            assert [v for step in ours for _, v in step] == pytest.approx([v for step in theirs for _, v in step],
                                                                           abs=1e-4)
        for tokens, (hf_tokens, hf_logprobs) in zip(replayed[rank]["greedy"], hf_reference):
            assert_greedy_matches(tokens, hf_tokens, hf_logprobs)
    assert replayed[0] == replayed[1], "every rank samples the same tokens"
