"""The prompt layout: how documents and a question become segments of token ids.

Tokens are the contract. Each piece is tokenized on its own and the pieces are joined as ids, so
the graft path and the text path feed exactly the same ids in exactly the same segments; the
joined string is never re-tokenized. The schedule for k documents is

    [prefix + doc 1] [doc 2] ... [doc k] [question + suffix]

where prefix and suffix come from the model's chat template (system turn, the opening of the user
turn; the end of the user turn and the opening of the assistant turn): the `chat` layout. A base
model has no chat template; its `completion` layout is a plain completion prompt, as one writes it
for such a model:

    <bos>{system}\n\n{doc 1}\n ... {doc k}\nQuestion: {question}\nAnswer:

(the tokenizer's begin-of-text token first when it adds one to plain text), and its answer ends at
the end of its line (a base model otherwise runs on into another `Question:`). The layout's
prefix opens every chain's first segment, so a state's key depends on its layout. Each document ends in one
newline and the next piece starts a new word, so each boundary falls where a BPE tokenizer splits
the joined text anyway (a blank line would not: "\\n\\n" before a word tokenizes as two newlines).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from kvrag.errors import EmptyTextError, InputError

__all__ = ["PromptLayout", "DEFAULT_SYSTEM_PROMPT", "LayoutKind", "LAYOUTS", "has_chat_template", "bos_ids"]

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant. Answer the question using the documents."
_SENTINEL = "\x00KVRAG-USER-CONTENT\x00"

#: `chat`: the model's chat template; `completion`: a plain completion prompt (base models)
LayoutKind = Literal["chat", "completion"]
LAYOUTS: tuple[str, ...] = get_args(LayoutKind)


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def bos_ids(tokenizer: Any) -> list[int]:
    """The begin-of-text id the tokenizer puts before plain text by default (Gemma's `<bos>`), or none:
    what a stock `tokenizer(text)` reads first, so a completion prompt starts as it would."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return []
    try:
        probe = tokenizer("a")["input_ids"]
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode a letter has no default to follow
        return []
    return [bos] if probe and probe[0] == bos else []


@dataclass(frozen=True)
class PromptLayout:
    """Token ids for the fixed parts of a prompt, and the rules for the variable parts."""

    tokenizer: Any
    prefix_ids: tuple[int, ...]
    suffix_ids: tuple[int, ...]
    stop_ids: frozenset[int]
    kind: LayoutKind = "chat"
    #: where an answer to `question_ids` ends, unless the caller gives its own stops
    answer_stops: tuple[str, ...] = ()
    _documents: "_RecentIds" = field(default_factory=lambda: _RecentIds(), init=False, compare=False, repr=False)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, system_prompt: str = DEFAULT_SYSTEM_PROMPT,
                      kind: LayoutKind | None = None) -> "PromptLayout":
        """The layout for `tokenizer`: `chat` when it has a chat template, else `completion`
        (`kind` forces one; `chat` without a template is refused)."""
        if kind is None:
            try:
                return cls.for_tokenizer(tokenizer, system_prompt, "chat" if has_chat_template(tokenizer) else "completion")
            except InputError:  # a template that cannot render a system and a user turn
                return cls.for_tokenizer(tokenizer, system_prompt, "completion")
        if kind not in LAYOUTS:
            raise InputError(f"unknown prompt layout {kind!r}; use one of {', '.join(LAYOUTS)}")
        stop = stop_ids_of(tokenizer)
        if kind == "completion":
            prefix = tuple(bos_ids(tokenizer)) + tuple(_ids(tokenizer, f"{system_prompt}\n\n" if system_prompt else ""))
            return cls(tokenizer, prefix, tuple(_ids(tokenizer, "\nAnswer:")), stop, "completion", ("\n",))
        if not has_chat_template(tokenizer):
            raise InputError("this model has no chat template; use the completion layout (--layout completion)")
        prefix_text, suffix_text = _split_template(tokenizer, system_prompt)
        return cls(tokenizer, _ids(tokenizer, prefix_text), _ids(tokenizer, suffix_text), stop, "chat")

    def tokenize(self, text: str) -> list[int]:
        """`text`'s token ids, without special tokens."""
        return _ids(self.tokenizer, text)

    def document_ids(self, text: str) -> list[int]:
        """The ids of one document's segment (without the prefix)."""
        if not text or not text.strip():
            raise EmptyTextError("cannot deposit an empty document; pass text with at least one word")
        return self._documents.ids(self.tokenizer, text.rstrip() + "\n")

    def question_ids(self, question: str) -> list[int]:
        """The ids of the final segment: the question and the answer cue (the opening of the
        assistant turn, or `\nAnswer:`)."""
        if not question or not question.strip():
            raise EmptyTextError("the query is empty; ask a question with at least one word")
        return _ids(self.tokenizer, "Question: " + question.strip()) + list(self.suffix_ids)

    def segment_ids(self, text: str, *, first: bool) -> list[int]:
        """A document's segment as fed to the model: the first one carries the prompt prefix."""
        ids = self.document_ids(text)
        return list(self.prefix_ids) + ids if first else ids


def stop_ids_of(tokenizer: Any) -> frozenset[int]:
    """The ids that end an answer: end of text, and the end-of-turn tokens templates use."""
    stop = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for token in ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>", "<|end|>"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            stop.add(token_id)
    return frozenset(stop)


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


class _RecentIds:
    """The ids of recently tokenized documents: the same retrieved documents come back question
    after question, and tokenizing a long document costs a share of a graft's time. Bounded by the
    characters it holds; a tokenizer is deterministic, so a remembered answer is its answer."""

    MAX_CHARS = 16 * 1024 * 1024

    def __init__(self) -> None:
        self._ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def ids(self, tokenizer: Any, text: str) -> list[int]:
        with self._lock:
            held = self._ids.get(text)
            if held is not None:
                self._ids.move_to_end(text)
                return list(held)
        ids = _ids(tokenizer, text)
        if len(text) <= self.MAX_CHARS // 4:
            with self._lock:
                if text not in self._ids:
                    self._ids[text] = tuple(ids)
                    self._chars += len(text)
                while self._chars > self.MAX_CHARS:
                    dropped, _ = self._ids.popitem(last=False)
                    self._chars -= len(dropped)
        return ids


def _split_template(tokenizer: Any, system_prompt: str) -> tuple[str, str]:
    attempts = [
        [{"role": "system", "content": system_prompt}, {"role": "user", "content": _SENTINEL}],
        [{"role": "user", "content": f"{system_prompt}\n\n{_SENTINEL}"}],  # templates without a system role
    ]
    for messages in attempts:
        try:
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template may refuse the system role in any way
            continue
        if isinstance(rendered, str) and rendered.count(_SENTINEL) == 1:
            prefix, suffix = rendered.split(_SENTINEL)
            return prefix, suffix
    raise InputError("the model's chat template cannot render a system and a user turn; use the completion layout")
