"""Structured outputs under load: the throughput run again with every request under one JSON schema.

The same requests and engine run unconstrained and then constrained, so the
ratio of the two throughputs is the cost of the grammar (bitmasks filled on the
host, applied on the device); the grammar's compile time is reported with it.
Requests still ignore EOS, but a request whose JSON is complete stops there.
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


def run_constrained(llm, prompts: list, params: list, baseline: dict) -> dict:
    """Compile the schema, then time ``llm.generate`` with every request under it."""
    from dovetail.bench.workload import warm_up
    from dovetail.sampling_params import StructuredOutputsParams

    spec = StructuredOutputsParams(json=BENCH_SCHEMA)
    manager = llm.llm_engine.structured
    t0 = time.perf_counter()
    manager.grammar_for(spec).result()
    first_grammar_s = time.perf_counter() - t0
    constrained = [p.model_copy(update={"structured_outputs": spec}) for p in params]
    warm_up(llm, prompts, constrained)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, constrained, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    per_s = out_tokens / elapsed
    return {
        "schema": BENCH_SCHEMA, "output_tokens": out_tokens, "seconds": elapsed, "output_tokens_per_s": per_s,
        "ratio_to_unconstrained": per_s / baseline["output_tokens_per_s"],
        "ended_by_grammar": sum(o.outputs[0].finish_reason == "stop" for o in outputs),
        "tokenizer_setup_seconds": manager.setup_seconds, "grammar_compile_seconds": manager.compile_seconds[0],
        "first_grammar_seconds": first_grammar_s,
    }
