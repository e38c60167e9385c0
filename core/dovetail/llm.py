"""LLM: the offline API, with vLLM's names (``generate``, ``chat``; ``embed``, ``classify``, ``score``)."""

from __future__ import annotations

import gc
from typing import Any, Sequence, Union

from tqdm.auto import tqdm

from dovetail.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from dovetail.config import EngineArgs
from dovetail.engine.frozen_heap import frozen_heap
from dovetail.engine.llm_engine import LLMEngine, PromptType
from dovetail.errors import RequestError
from dovetail.lora.request import LoRARequest
from dovetail.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, RequestOutput,
                              ScoringRequestOutput)
from dovetail.pooling import PoolingParams, pair_texts
from dovetail.sampling_params import RequestOutputKind, SamplingParams

Message = dict[str, Any]


def default_model() -> str:
    """The directory of the small model bundled with Dovetail (it adds and subtracts numbers)."""
    from importlib import resources

    return str(resources.files("dovetail") / "assets" / "bundled-model")


class LLM:
    """Generate text offline from a local model directory.

    ``LLM(model=..., device=..., attention_backend=..., quantization=..., dtype=..., **engine_args)``;
    the engine arguments are those of :class:`dovetail.config.EngineArgs`
    (``max_model_len``, ``block_size``, ``max_num_seqs``, ``enable_prefix_caching``, ...).
    Without ``model``, the bundled model is used.
    """

    def __init__(self, model: str | None = None, *, device: str | None = None,
                 attention_backend: str | None = None, quantization: str | None = None,
                 dtype: str | None = None, **engine_args):
        args = EngineArgs(model or default_model(), device=device, attention_backend=attention_backend,
                          quantization=quantization, dtype=dtype, **engine_args)
        self.llm_engine = LLMEngine(args.create_engine_config())
        self._counter = 0

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use without ``sampling_params``: SamplingParams' defaults with the
        model's ``generation_config.json`` on top (``generation_config="vllm"`` leaves them out)."""
        return SamplingParams(**self.llm_engine.default_sampling)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (see :meth:`LLMEngine.reset_prefix_cache`); True once done."""
        return self.llm_engine.reset_prefix_cache()

    def start_profile(self) -> None:
        """Start torch.profiler on every rank; needs ``DOVETAIL_TORCH_PROFILER_DIR`` (traces go there)."""
        self.llm_engine.start_profile()

    def stop_profile(self) -> list[str]:
        """Stop it and write each rank's trace and summary; the summaries' paths."""
        return self.llm_engine.stop_profile()

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for each prompt; outputs come back in input order.

        A prompt is a string, ``{"prompt_token_ids": [...]}`` or ``{"prompt": "..."}``.
        ``sampling_params`` is one :class:`SamplingParams` for all prompts or one per prompt, and so is
        ``lora_request`` (an engine with ``enable_lora=True``; None: the base model).
        """
        prompts = self._prompt_list(prompts)
        params = self._final_only(self._params_list(sampling_params, len(prompts)))
        if priority is not None and len(priority) != len(prompts):
            raise RequestError(f"priority: got {len(priority)} priorities for {len(prompts)} prompts", field="priority")
        loras = self._per_prompt(lora_request, LoRARequest, len(prompts), "lora_request")
        return self._add_all(self._tokenized(prompts), params, priority, use_tqdm, loras)

    def _add_all(self, prompts: list[PromptType], params: list, priority: list[int] | None,
                 use_tqdm: bool, loras: list[LoRARequest | None] | None = None) -> list:
        """Queue every prompt with its parameters, then run the engine until all of them finished."""
        engine = self.llm_engine
        ids = []
        # Thousands of new requests, none of them garbage: the collector would only walk the heap again and again.
        collecting = gc.isenabled()
        gc.disable()
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = f"llm-{self._counter}"
                self._counter += 1
                engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0,
                                   lora_request=loras[i] if loras else None)
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)
            raise
        finally:
            if collecting:
                gc.enable()
        return self._run(ids, use_tqdm)

    def embed(self, prompts: Union[PromptType, Sequence[PromptType]],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Embed each prompt with a pooling model (``runner="pooling"``, or a base-model checkpoint);
        outputs come back in input order, each vector in ``output.outputs.embedding``."""
        prompts = self._prompt_list(prompts)
        params = self._per_prompt(pooling_params or PoolingParams(), PoolingParams, len(prompts), "pooling_params")
        params = [p if p.task == "embed" else p.model_copy(update={"task": "embed"}) for p in params]
        return self._add_all(self._pooled_prompts(prompts, params), params, None, use_tqdm)

    def classify(self, prompts: Union[PromptType, Sequence[PromptType]], use_tqdm: bool = True,
                 truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
        """Classify each prompt with a sequence classifier (``*ForSequenceClassification``); outputs come back
        in input order, each label's probability in ``output.outputs.probs``."""
        prompts = self._prompt_list(prompts)
        params = [PoolingParams(task="classify", truncate_prompt_tokens=truncate_prompt_tokens)] * len(prompts)
        return self._add_all(self._pooled_prompts(prompts, params), params, None, use_tqdm)

    def score(self, text_1: Union[str, Sequence[str]], text_2: Union[str, Sequence[str]],
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """A cross-encoder's relevance score of each pair: one ``text_1`` against every ``text_2``, or the two
        lists pair by pair. Each pair is one prompt, the tokenizer's pair encoding of the two texts."""
        queries, documents = pair_texts(text_1, text_2)
        prompts = [{"prompt_token_ids": ids} for ids in self.llm_engine.pair_token_ids(queries, documents)]
        params = [PoolingParams(task="score")] * len(prompts)
        return self._add_all(prompts, params, None, use_tqdm)

    def beam_search(self, prompts: Union[PromptType, Sequence[PromptType]], params: BeamSearchParams,
                    lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
        """The best ``params.beam_width`` continuations of each prompt by beam search (vLLM's
        ``LLM.beam_search``; see :mod:`dovetail.beam_search`), in input order; every beam with
        ``lora_request``'s adapter when given."""
        def generate(*args, **kwargs):
            return self.generate(*args, lora_request=lora_request, **kwargs)

        return beam_search(self.llm_engine, generate, self._prompt_list(prompts), params)

    def chat(self, messages: Union[list[Message], list[list[Message]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the tokenizer's chat template
        (which also receives ``tools`` and the variables of ``chat_template_kwargs``)."""
        tokenizer = self.llm_engine.tokenizer
        if tokenizer is None:
            raise RequestError("messages: this model has no tokenizer, so it has no chat template", field="messages")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            try:
                ids = tokenizer.apply_chat_template(conversation, chat_template=chat_template, tokenize=True,
                                                    add_generation_prompt=add_generation_prompt, tools=tools,
                                                    **(chat_template_kwargs or {}))
            except ValueError as exc:
                raise RequestError(f"messages: cannot apply the chat template: {exc}", field="messages") from exc
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _pooled_prompts(self, prompts: list[PromptType], params: list[PoolingParams]) -> list[PromptType]:
        """The prompts, tokenised together unless a request truncates its prompt (the engine tokenises those
        without the early length check)."""
        if any(p.truncate_prompt_tokens is not None for p in params):
            return prompts
        return self._tokenized(prompts)

    @staticmethod
    def _prompt_list(prompts) -> list[PromptType]:
        """One prompt (a string, a dict or a list of token ids) or a sequence of them, as a list."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            return [prompts]
        return list(prompts)

    def _tokenized(self, prompts: list[PromptType]) -> list[PromptType]:
        """Text prompts with their token ids, tokenised together (the tokenizer's batch call is much
        cheaper than one call per prompt)."""
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str)
                 or (isinstance(p, dict) and "prompt_token_ids" not in p and isinstance(p.get("prompt"), str))]
        if len(texts) < 2 or self.llm_engine.tokenizer is None:
            return prompts
        strings = [prompts[i] if isinstance(prompts[i], str) else prompts[i]["prompt"] for i in texts]
        ids = self.llm_engine.prompt_tokenizer.encode_many(strings, ["prompt"] * len(strings))
        prompts = list(prompts)
        for i, text, token_ids in zip(texts, strings, ids):
            prompts[i] = {"prompt": text, "prompt_token_ids": token_ids}
        return prompts

    @staticmethod
    def _final_only(params: list[SamplingParams]) -> list[SamplingParams]:
        """The parameters with ``output_kind`` FINAL_ONLY: one copy per distinct object, not one per prompt."""
        copies: dict[int, SamplingParams] = {}
        for p in params:
            if id(p) not in copies:
                copies[id(p)] = p if p.output_kind == RequestOutputKind.FINAL_ONLY \
                    else p.model_copy(update={"output_kind": RequestOutputKind.FINAL_ONLY})
        return [copies[id(p)] for p in params]

    def _params_list(self, sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params() for _ in range(count)]
        return self._per_prompt(sampling_params, SamplingParams, count, "sampling_params")

    @staticmethod
    def _per_prompt(value, one: type, count: int, field: str) -> list:
        """``value`` for each of ``count`` prompts: one ``one`` (or None) for all of them, or one per prompt."""
        if value is None or isinstance(value, one):
            return [value] * count
        values = list(value)
        if len(values) != count:
            raise RequestError(f"{field}: got {len(values)} for {count} prompts", field=field)
        return values

    def _run(self, ids: list[str], use_tqdm: bool) -> list:
        engine = self.llm_engine
        pending = set(ids)
        results: dict = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            with frozen_heap():
                while pending or engine.has_unfinished_requests():  # also drains a step in flight
                    for out in engine.step():
                        if out.finished and out.request_id in pending:
                            results[out.request_id] = out
                            pending.discard(out.request_id)
                            bar.update(1)
        except BaseException:
            engine.abort_request(list(pending))
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]
