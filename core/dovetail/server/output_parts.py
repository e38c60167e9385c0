"""A chat choice's deltas as the parts of another API's output: Responses items, Anthropic content blocks.

The chat stream (:class:`~dovetail.server.chat_output.ChoiceStream`) gives ``reasoning_content``, ``content``
and ``tool_calls`` deltas. Consecutive pieces of reasoning make one part, consecutive pieces of text another,
and each tool call a part of its own. :class:`OutputParts` keeps that bookkeeping; a subclass says how its
API announces a part, each piece of it and its end.
"""

from __future__ import annotations

from typing import Optional

REASONING, TEXT, CALL = "reasoning", "text", "call"


class OutputParts:
    """The parts of one output as its deltas arrive; :meth:`feed` and :meth:`close` return the events to send."""

    def __init__(self):
        self.parts: list[dict] = []
        self.open: Optional[dict] = None
        self.open_kind: Optional[str] = None
        self.text = ""  # the open part's text (a call's: its arguments' JSON) so far

    # -- what a subclass says ---------------------------------------------------------------------------

    def started(self, kind: str, call_id: Optional[str] = None, name: Optional[str] = None) -> tuple[dict, list[dict]]:
        """A new part of ``kind`` (a call's id and name given) and the events that announce it."""
        raise NotImplementedError

    def grown(self, piece: str) -> dict:
        """The event for ``piece`` added to the open part (already in :attr:`text`)."""
        raise NotImplementedError

    def finished(self, status: str) -> list[dict]:
        """Complete the open part from :attr:`text`; the events that end it (before it joins :attr:`parts`)."""
        raise NotImplementedError

    # -- the bookkeeping ------------------------------------------------------------------------------------

    def feed(self, delta: dict) -> list[dict]:
        """The events for one delta of the chat stream."""
        events = []
        if delta.get("reasoning_content"):
            events += self._append(REASONING, delta["reasoning_content"])
        if delta.get("content"):
            events += self._append(TEXT, delta["content"])
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):
                events += self.close()
                events += self._start(CALL, call["id"], function.get("name"))
            if function.get("arguments") and self.open_kind == CALL:
                self.text += function["arguments"]
                events.append(self.grown(function["arguments"]))
        return events

    def add_message(self, message: dict, status: str = "completed") -> None:
        """Every part of a finished chat message (its reasoning, content and tool calls), the last one closed
        with ``status``."""
        self.feed({"reasoning_content": message.get("reasoning_content"), "content": message.get("content")})
        self.feed({"tool_calls": message.get("tool_calls")})
        self.close(status)

    def _append(self, kind: str, piece: str) -> list[dict]:
        events = [] if self.open_kind == kind else self.close() + self._start(kind)
        self.text += piece
        return events + [self.grown(piece)]

    def _start(self, kind: str, call_id: Optional[str] = None, name: Optional[str] = None) -> list[dict]:
        self.text, self.open_kind = "", kind
        self.open, events = self.started(kind, call_id, name)
        return events

    def close(self, status: str = "completed") -> list[dict]:
        """Finish the open part, if any, with ``status`` (``completed``, or ``incomplete`` where cut short)."""
        if self.open is None:
            return []
        events = self.finished(status)
        self.parts.append(self.open)
        self.open, self.open_kind, self.text = None, None, ""
        return events

    @property
    def index(self) -> int:
        """The position of the open part."""
        return len(self.parts)


async def chat_deltas(stream, tracker, choice):
    """For each output of a one-choice engine ``stream`` that brings news: ``(output, its completion, the chat
    delta of ``choice``, a :class:`~dovetail.server.chat_output.ChoiceStream`)``."""
    async for item in stream:
        tracker.observe(item)
        out = item.output
        completion = out.outputs[0]
        delta_text, delta_ids = out.deltas[0]
        done = completion.finish_reason is not None
        if delta_text or delta_ids or done:
            yield out, completion, choice.delta(delta_text, final=done, new_tokens=bool(delta_ids))
