"""Whole prompts as a framework formats them: chat messages rendered with the model's own chat
template, tokenized once, and cut into segments where the prompt's content says so.

Drop-in pipelines (LangChain's prompt templates, LlamaIndex's query engines, an OpenAI-style
request) hand kvrag a finished prompt, not documents and a question. The rendered prompt is
tokenized as one string, exactly the ids a stock `model.generate` on it would read, and cut:

  - at the end of every message but the last, so turn N grafts turns 1..N-1;
  - after a token that ends a line, once at least `MIN_SEGMENT_TOKENS` tokens have passed since
    the previous cut (every framework's default template joins retrieved documents by newlines).

Each cut depends only on what comes before it, so two prompts that begin alike are cut alike up to
where they differ, and their common segments are the same content-addressed states: whatever the
template puts around the documents is part of what is stored, and the same template reuses it.
Everything after the last cut is the feed. The text path reads the same segments, so a graft is
exact against it.

A model without a chat template (a base model) gets chat messages in a documented plain form,
`System: ...\n\nUser: ...\n\nAssistant:` after its begin-of-text token, and its answer ends
where it starts a new `\nUser:` turn. A completion prompt (`render_prompt`) is read as given, after
the begin-of-text token a stock `tokenizer(prompt)` puts first: exactly what `model.generate` on it
would read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, ValidationError

from kvrag.core.prompt import bos_ids, has_chat_template
from kvrag.errors import EmptyTextError, InputError

__all__ = ["Message", "Transcript", "Renderer", "MIN_SEGMENT_TOKENS", "messages_of", "PLAIN_CHAT_STOPS"]

#: where an answer to plainly rendered chat messages ends (a base model runs on into the next turn)
PLAIN_CHAT_STOPS = ("\nUser:",)

#: The fewest tokens between two cuts made at line ends (message ends are always cut).
MIN_SEGMENT_TOKENS = 32

Role = Literal["system", "user", "assistant", "tool"]


class Message(BaseModel):
    """One chat message, in the OpenAI shape (`{"role": ..., "content": ...}`)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    role: Role
    content: str


def messages_of(messages: Sequence[Message | Mapping[str, Any]]) -> list[Message]:
    """`messages` as `Message`s; an `InputError` says which one is malformed."""
    checked: list[Message] = []
    for index, message in enumerate(messages):
        try:
            checked.append(message if isinstance(message, Message) else Message.model_validate(dict(message)))
        except (ValidationError, TypeError, ValueError) as e:
            raise InputError(
                f"message {index} is not a chat message: give a role (system, user, assistant or tool) and text "
                f"content ({' '.join(str(e).split())[:200]})"
            ) from e
    if not checked or not any(m.content.strip() for m in checked):
        raise EmptyTextError("the conversation is empty; send at least one message with text")
    return checked


@dataclass(frozen=True)
class Transcript:
    """A rendered prompt's ids and where they are cut: `cuts` are the token indices where a new
    segment starts (ascending, each inside the prompt), so the last piece is never empty."""

    text: str
    ids: list[int]
    cuts: list[int]
    pieces_text: list[str]

    def pieces(self) -> list[tuple[str, list[int]]]:
        """(text, ids) for every segment, the feed last."""
        bounds = [0, *self.cuts, len(self.ids)]
        return [(self.pieces_text[i], self.ids[a:b]) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]


class Renderer:
    """Renders and cuts prompts for one tokenizer (its chat template, or a plain fallback)."""

    def __init__(self, tokenizer: Any, min_segment_tokens: int = MIN_SEGMENT_TOKENS) -> None:
        self.tokenizer = tokenizer
        self.min_segment_tokens = min_segment_tokens
        self._line_ends: dict[int, bool] = {}
        #: `template` (the model's chat template) or `plain` (the documented fallback)
        self.chat_form = "template" if has_chat_template(tokenizer) else "plain"
        #: what a stock `tokenizer(prompt)` puts first; a chat template writes its own instead
        self._prompt_bos = bos_ids(tokenizer)
        self._bos = [] if self.chat_form == "template" else self._prompt_bos
        #: where a chat answer ends unless the caller says
        self.chat_stops: tuple[str, ...] = () if self.chat_form == "template" else PLAIN_CHAT_STOPS

    def render_prompt(self, prompt: str) -> Transcript:
        """A completion prompt read as given (after the tokenizer's begin-of-text token), cut at line ends."""
        if not prompt or not prompt.strip():
            raise EmptyTextError("the prompt is empty; send text with at least one word")
        ids = self._prompt_bos + self._plain_ids(prompt)
        cuts = self._cuts(ids, set())
        bounds = [0, *cuts, len(ids)]
        pieces = [self.tokenizer.decode(ids[a:b]) for a, b in zip(bounds, bounds[1:])]
        return Transcript(prompt, ids, cuts, pieces)

    def render(self, messages: Sequence[Message], *, generation_prompt: bool = True) -> Transcript:
        """The prompt for `messages` (with the opening of the assistant's turn when
        `generation_prompt`), tokenized once and cut."""
        messages = list(messages)
        text = self._text(messages, generation_prompt)
        ids = self._ids(text)
        if not ids:
            raise EmptyTextError("the rendered prompt is empty")
        boundaries = set()
        for count in range(1, len(messages) if generation_prompt else len(messages) + 1):
            try:
                prefix = self._text(messages[:count], False)
            except InputError:  # e.g. a template that cannot render a conversation opening with a system turn
                continue
            if text.startswith(prefix):
                prefix_ids = self._ids(prefix)
                if ids[: len(prefix_ids)] == prefix_ids:
                    boundaries.add(len(prefix_ids))
        cuts = self._cuts(ids, boundaries)
        bounds = [0, *cuts, len(ids)]
        pieces = [self.tokenizer.decode(ids[a:b]) for a, b in zip(bounds, bounds[1:])]
        return Transcript(text, ids, cuts, pieces)

    def _cuts(self, ids: list[int], boundaries: set[int]) -> list[int]:
        cuts: list[int] = []
        last = 0
        for end in range(1, len(ids)):  # a cut at `end` starts a new segment there; never at len(ids)
            if end in boundaries or (end - last >= self.min_segment_tokens and self._ends_line(ids[end - 1])):
                cuts.append(end)
                last = end
        return cuts

    def _ends_line(self, token: int) -> bool:
        known = self._line_ends.get(token)
        if known is None:
            known = self._line_ends[token] = self.tokenizer.decode([token]).endswith("\n")
        return known

    def _ids(self, text: str) -> list[int]:
        return self._bos + self._plain_ids(text) if text else []

    def _plain_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def _text(self, messages: list[Message], generation_prompt: bool) -> str:
        if self.chat_form == "plain":
            names = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}
            text = "".join(f"{names[m.role]}: {m.content}\n\n" for m in messages)
            return text + ("Assistant:" if generation_prompt else "")
        plain = [{"role": m.role, "content": m.content} for m in messages]
        try:
            return self.tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as first:  # noqa: BLE001 - a template may refuse a role or an order in any way
            merged = _system_into_user(plain)
            if merged == plain:
                raise InputError(f"the model's chat template refused these messages: {first}") from first
            try:
                return self.tokenizer.apply_chat_template(merged, tokenize=False, add_generation_prompt=generation_prompt)
            except Exception as e:  # noqa: BLE001
                raise InputError(f"the model's chat template refused these messages: {e}") from e


def _system_into_user(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """For templates without a system role: system text opens the first user message."""
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    rest = [dict(m) for m in messages if m["role"] != "system"]
    if not system or not rest or rest[0]["role"] != "user":
        return messages
    rest[0]["content"] = f"{system}\n\n{rest[0]['content']}"
    return rest
