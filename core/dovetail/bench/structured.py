"""Structured outputs under load: the throughput run again with every request under one JSON schema.

Requests still ignore EOS, but a request whose JSON is complete stops there, so
the constrained run may generate fewer tokens than the unconstrained one: the
same requests then run unconstrained again, each cut to its constrained length,
and the ratio of those two throughputs is the cost of the grammar (bitmasks
filled on the host, applied on the device). The grammar's compile time is
reported with it.
"""

from __future__ import annotations

import time

#: One schema for every request: fields of several kinds, the last a free text so outputs can run long.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "summary": {"type": "string"},
    },
    "required": ["id", "name", "tags", "summary"],
}


def _timed_generate(llm, prompts: list, params: list) -> tuple[list, float]:
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs, time.perf_counter() - t0


def run_constrained(llm, prompts: list, params: list, baseline: dict) -> dict:
    """Compile the schema, time ``llm.generate`` with every request under it, then time the same requests
    unconstrained, each cut to the length its constrained output reached (a request stops where its JSON
    is complete, so the two runs generate the same tokens per request)."""
    from dovetail.bench.workload import warm_up
    from dovetail.sampling_params import StructuredOutputsParams

    spec = StructuredOutputsParams(json=BENCH_SCHEMA)
    manager = llm.llm_engine.structured
    t0 = time.perf_counter()
    manager.grammar_for(spec).result()
    first_grammar_s = time.perf_counter() - t0
    constrained = [p.model_copy(update={"structured_outputs": spec}) for p in params]
    warm_up(llm, prompts, constrained)
    outputs, elapsed = _timed_generate(llm, prompts, constrained)
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    matched = [p.model_copy(update={"max_tokens": n}) for p, n in zip(params, lengths)]
    _, matched_elapsed = _timed_generate(llm, prompts, matched)
    out_tokens = sum(lengths)
    per_s, matched_per_s = out_tokens / elapsed, out_tokens / matched_elapsed
    return {
        "schema": BENCH_SCHEMA, "output_tokens": out_tokens, "seconds": elapsed, "output_tokens_per_s": per_s,
        "ended_by_grammar": sum(o.outputs[0].finish_reason == "stop" for o in outputs),
        "unconstrained_same_lengths": {"seconds": matched_elapsed, "output_tokens_per_s": matched_per_s},
        "ratio_to_unconstrained": per_s / matched_per_s,
        "ratio_to_full_run": per_s / baseline["output_tokens_per_s"],
        "tokenizer_setup_seconds": manager.setup_seconds, "grammar_compile_seconds": manager.compile_seconds[0],
        "first_grammar_seconds": first_grammar_s,
    }
