"""What decoding produces: token ids turned into text deltas, a stream of them, and the result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from kvrag.core.receipt import Receipt

__all__ = ["Generation", "GenerationStream", "TextDecoder", "cut_at_stops"]


@dataclass
class Generation:
    """An answer, its token ids, its receipt, and the first token's logits (for verification)."""

    text: str
    tokens: list[int]
    receipt: Receipt
    first_token_logits: torch.Tensor = field(repr=False)
    finish_reason: str = "stop"  # "stop": an end token or stop string; "length": max_new_tokens


class GenerationStream:
    """The answer's text, delta by delta; after the last one, `generation` holds the result."""

    def __init__(self, steps: Iterator[str]) -> None:
        self._steps = steps
        self.generation: Generation | None = None

    def __iter__(self) -> Iterator[str]:
        self.generation = yield from self._steps

    def result(self) -> Generation:
        """Run to the end (if not already) and return the generation."""
        if self.generation is None:
            for _ in self:
                pass
        assert self.generation is not None
        return self.generation


def cut_at_stops(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """`text` up to the first stop string after its leading whitespace (which is never part of an
    answer: an answer that opens with a newline has not ended), and whether one was found."""
    begins = len(text) - len(text.lstrip())
    cuts = [at for at in (text.find(s, begins) for s in stops if s) if at >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


class TextDecoder:
    """Token ids to text deltas: whole characters only, cut at the first stop string.

    `known` ids are an answer's beginning already given (a memo recall): they are part of the
    text and of the first delta, and decoding continues after them.
    """

    def __init__(self, tokenizer: Any, stop_ids: frozenset[int], stop: Sequence[str], known: Sequence[int] = ()) -> None:
        self.tokenizer, self.stop_ids, self.stop = tokenizer, stop_ids, [s for s in stop if s]
        self.ids: list[int] = list(known)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True) if self.ids else ""
        self.emitted = 0
        self.done = False
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def push(self, token: int) -> Iterator[str]:
        if self.done:
            return
        if token in self.stop_ids:
            self.done = True
            return
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a character split across tokens: wait for the rest
            return
        text, self.done = self._cut(text)
        self.text = text
        yield from self._emit(len(text) if self.done else len(text) - self._hold)

    def _cut(self, text: str) -> tuple[str, bool]:
        return cut_at_stops(text, self.stop)

    def flush(self) -> Iterator[str]:
        if not self.done:  # whatever is left, replacement characters included
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            self.text, self.done = self._cut(text)
        yield from self._emit(len(self.text))

    def _emit(self, upto: int) -> Iterator[str]:
        if upto > self.emitted:
            delta = self.text[self.emitted : upto]
            if not self.text[: self.emitted].strip():  # nothing but whitespace so far: the answer has not begun
                delta = delta.lstrip()
            self.emitted = upto
            if delta:
                yield delta
