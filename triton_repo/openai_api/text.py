"""Token ids -> text for one OpenAI choice: incremental detokenization and stop strings.

OpenAI's `stop` is a string match on the output text, and the matched string is
not part of the answer. Token-level stop words cannot do that (the same text
tokenizes differently in context), so the frontend matches text and, on a hit,
ends the request (which cancels it in the engine). While streaming, text that
could still turn out to begin a stop string is held back until it cannot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import protocol


def _held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` might be the start of a stop string."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold


@dataclass
class ChoiceText:
    tokenizer: object
    stops: list[str]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""  # the settled text (the whole answer so far, stop strings cut)
    emitted: int = 0  # characters of `text` already handed out
    stopped: bool = False  # a stop string matched: the answer is complete

    def add(self, ids: list[int], logprobs: list[float] | None, final: bool) -> str:
        """Feed one engine response; returns the text that may be shown now."""
        prev = len(self.ids)
        self.ids += ids
        if logprobs is not None:
            self.logprobs += logprobs
        self.text += protocol.text_delta(self.tokenizer, self.ids, prev, final) if ids or final else ""
        for s in self.stops:
            at = self.text.find(s, max(0, self.emitted - len(s) + 1))
            if at >= 0:
                self.text, self.stopped = self.text[:at], True
        end = len(self.text) if (final or self.stopped) else len(self.text) - _held_back(self.text, self.stops)
        out = self.text[self.emitted : max(end, self.emitted)]
        self.emitted = max(end, self.emitted)
        return out

    def token_strings(self) -> list[str]:
        """Each generated token as text (OpenAI's logprobs `tokens`)."""
        return [self.tokenizer.decode([i]) for i in self.ids]
