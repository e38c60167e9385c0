"""After sampling: logprobs, incremental text, stop rules, and the RequestOutputs users see.

Stop rules, in vLLM's order, once ``min_tokens`` are out: EOS (unless
``ignore_eos``), a token of ``stop_token_ids``, a ``stop`` string (cut from the
text unless ``include_stop_str_in_output``), then ``max_tokens`` and
``max_model_len`` (finish reason ``length``). While a request streams, the tail
that could still become a stop string is held back.
"""

from __future__ import annotations

from dovetail.engine.detokenizer import IncrementalDetokenizer
from dovetail.engine.request import Request, RequestStatus
from dovetail.outputs import CompletionOutput, Logprob, RequestOutput
from dovetail.sampling_params import RequestOutputKind


class OutputProcessor:
    """Applies each sampled token to its request and builds outputs."""

    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def attach(self, req: Request) -> None:
        # Text is built token by token only when someone can see it before the end (or stop strings
        # need it); a final-only request is decoded once, when it finishes.
        incremental = bool(req.params.stop_strings) or req.params.output_kind != RequestOutputKind.FINAL_ONLY
        if self.tokenizer is not None and incremental:
            req.detokenizer = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, req.params.skip_special_tokens,
                req.params.spaces_between_special_tokens)

    def _token_text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

    def _position_logprobs(self, chosen: int, chosen_lp: float, rank: int, top: list[tuple[int, float]]):
        entry = {chosen: Logprob(chosen_lp, rank, self._token_text(chosen))}
        for r, (token, lp) in enumerate(top, start=1):
            if token not in entry:
                entry[token] = Logprob(lp, r, self._token_text(token))
        return entry

    def add_prompt_logprobs(self, req: Request, predicted_positions: list[int], infos: list) -> None:
        """Append the logprobs of the prompt tokens at ``predicted_positions`` (computed by a worker:
        per position the token's logprob, its rank and the top ``(token, logprob)``)."""
        for pos, (chosen_lp, rank, top) in zip(predicted_positions, infos):
            req.prompt_logprobs.append(self._position_logprobs(req.prompt_token_ids[pos], chosen_lp, rank, top))

    def append_token(self, req: Request, token: int, logprob_info, now: float) -> None:
        req.append_token(token)
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        if logprob_info is not None:
            chosen_lp, rank, top = logprob_info
            req.cumulative_logprob += chosen_lp
            req.logprobs.append(self._position_logprobs(token, chosen_lp, rank, top))
        params = req.params
        num_out = len(req.output_token_ids)
        stopped_by_token = False
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                req.finish_reason, stopped_by_token = "stop", True
            elif params.stop_token_ids and token in params.stop_token_ids:
                req.finish_reason, req.stop_reason, stopped_by_token = "stop", token, True
        if req.detokenizer is not None and not stopped_by_token:
            delta = req.detokenizer.step(token)
            if delta:
                req.output_text += delta
                if num_out >= params.min_tokens and params.stop_strings:
                    self._check_stop_strings(req, len(delta))
        if req.finish_reason is None:
            if num_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
                req.finish_reason = "length"
        if req.finish_reason is not None:
            self.finish(req, req.finish_reason)

    def _check_stop_strings(self, req: Request, new_chars: int) -> None:
        text = req.output_text
        for stop in req.params.stop_strings:
            start = max(0, len(text) - new_chars - len(stop) + 1)
            found = text.find(stop, start)
            if found != -1:
                end = found + len(stop) if req.params.include_stop_str_in_output else found
                req.output_text = text[:end]
                req.finish_reason, req.stop_reason = "stop", stop
                return

    def finish(self, req: Request, reason: str) -> None:
        if req.detokenizer is not None and reason == "length":
            req.output_text += req.detokenizer.flush()
        elif req.detokenizer is None and self.tokenizer is not None and reason != "abort":
            ids = req.output_token_ids
            if reason == "stop":  # without stop strings only a token (EOS or stop_token_ids) can stop it
                ids = ids[:-1]  # and that token is not part of the text
            req.output_text = self.tokenizer.decode(
                ids, skip_special_tokens=req.params.skip_special_tokens,
                spaces_between_special_tokens=req.params.spaces_between_special_tokens)
        req.finish_reason = reason
        req.status = RequestStatus.FINISHED

    def _visible_text(self, req: Request) -> str:
        """The text that may be shown now: all of it once finished, else minus a possible stop-string prefix."""
        text = req.output_text
        if req.is_finished or not req.params.stop_strings or req.params.include_stop_str_in_output:
            return text
        hold = max(len(s) for s in req.params.stop_strings) - 1
        return text[: max(len(text) - hold, req.sent_text_len)] if hold > 0 else text

    def request_output(self, request_id: str, prompt, prompt_token_ids: list[int],
                       children: list[Request]) -> RequestOutput:
        delta_only = children[0].params.output_kind == RequestOutputKind.DELTA
        completions, deltas = [], []
        for child in children:
            text = self._visible_text(child)
            delta = (text[child.sent_text_len:], child.output_token_ids[child.sent_token_len:])
            deltas.append(delta)
            child.sent_text_len, child.sent_token_len = len(text), len(child.output_token_ids)
            completions.append(CompletionOutput(
                index=child.index, text=delta[0] if delta_only else text,
                token_ids=list(delta[1] if delta_only else child.output_token_ids),
                cumulative_logprob=child.cumulative_logprob if child.logprobs is not None else None,
                logprobs=None if child.logprobs is None else list(child.logprobs), finish_reason=child.finish_reason, stop_reason=child.stop_reason))
        first = children[0]
        return RequestOutput(
            request_id=request_id, prompt=prompt, prompt_token_ids=list(prompt_token_ids), outputs=completions,
            finished=all(c.is_finished for c in children), prompt_logprobs=first.prompt_logprobs,
            num_cached_tokens=first.num_cached_tokens, metrics=first.metrics, deltas=deltas)
