"""Beam search over the engine, as vLLM's ``LLM.beam_search`` does it.

Each step asks the engine for one token of every live beam with the top ``2 * beam_width`` logprobs, and
keeps, per prompt, the ``beam_width`` best extensions by length-penalised cumulative logprob. A beam that
ends in EOS (unless ``ignore_eos``) is set aside as complete. Every step re-sends each beam's whole token
list: prefix caching finds its blocks, so only the newest tokens are computed again. At the end, the
complete and live beams of each prompt are ranked together and the best ``beam_width`` returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from pydantic import Field

from dovetail.outputs import PositionLogprobs
from dovetail.sampling_params import RequestParams, SamplingParams

#: The engine returns at most 20 logprobs a token, and a step needs ``2 * beam_width`` of them.
MAX_BEAM_WIDTH = 10


class BeamSearchParams(RequestParams):
    """Parameters of :meth:`dovetail.LLM.beam_search` (vLLM's names)."""

    beam_width: int = Field(ge=1, le=MAX_BEAM_WIDTH)
    max_tokens: int = Field(ge=1)
    ignore_eos: bool = False
    temperature: float = Field(default=0.0, ge=0.0)
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False


@dataclass
class BeamSearchSequence:
    """One beam: the prompt's tokens then the generated ones, their logprobs and its score's parts."""

    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_ids: set[int], length_penalty: float) -> float:
    """The cumulative logprob divided by the length (a final EOS not counted) to the power ``length_penalty``."""
    length = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] in eos_token_ids else 0)
    return beam.cum_logprob / (length ** length_penalty)


@dataclass
class _Prompt:
    prompt_len: int
    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)


def beam_search(engine, generate: Callable, prompts: Sequence, params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Beam search for each prompt (a string, token ids or ``{"prompt_token_ids": [...]}``), in input order, on
    ``engine`` (an :class:`~dovetail.engine.llm_engine.LLMEngine`) through ``generate`` (``LLM.generate``)."""
    eos = set(engine.eos_token_ids)
    width = params.beam_width
    step_params = SamplingParams(logprobs=2 * width, max_tokens=1, temperature=params.temperature,
                                 ignore_eos=True, skip_special_tokens=False)
    states = []
    for prompt in prompts:
        _, ids = engine.prompt_ids(prompt)
        engine.validate_request(ids, SamplingParams(max_tokens=params.max_tokens))
        states.append(_Prompt(len(ids), [BeamSearchSequence(list(ids))]))
    for _ in range(params.max_tokens):
        live = [(state, beam) for state in states for beam in state.beams]
        if not live:
            break
        outputs = generate([{"prompt_token_ids": beam.tokens} for _, beam in live], step_params, use_tqdm=False)
        candidates: dict[int, list[BeamSearchSequence]] = {id(state): [] for state in states}
        for (state, beam), output in zip(live, outputs):
            top = output.outputs[0].logprobs[0]
            for token, logprob in top.items():
                extended = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top],
                                              beam.cum_logprob + logprob.logprob)
                if token in eos and not params.ignore_eos:
                    extended.finish_reason = "stop"
                    state.completed.append(extended)
                else:
                    candidates[id(state)].append(extended)
        for state in states:
            ranked = sorted(candidates[id(state)], key=lambda b: beam_score(b, eos, params.length_penalty),
                            reverse=True)
            state.beams = ranked[:width]
    tokenizer = engine.tokenizer
    results = []
    for state in states:
        for beam in state.beams:
            beam.finish_reason = beam.finish_reason or "length"
        best = sorted(state.completed + state.beams, key=lambda b: beam_score(b, eos, params.length_penalty),
                      reverse=True)[:width]
        for beam in best:
            generated = beam.tokens[state.prompt_len:]
            if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
                generated = generated[:-1]
            beam.text = tokenizer.decode(generated, skip_special_tokens=True) if tokenizer is not None else None
        results.append(BeamSearchOutput(best))
    return results
