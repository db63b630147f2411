"""The prompt layout: how documents and a question become segments of token ids.

Tokens are the contract. Each piece is tokenized on its own and the pieces are joined as ids, so
the graft path and the text path feed exactly the same ids in exactly the same segments; the
joined string is never re-tokenized. The schedule for k documents is

    [prefix + doc 1] [doc 2] ... [doc k] [question + suffix]

where prefix and suffix come from the model's chat template (system turn, the opening of the user
turn; the end of the user turn and the opening of the assistant turn). Each document ends in one
newline and the next piece starts a new word, so each boundary falls where a BPE tokenizer splits
the joined text anyway (a blank line would not: "\\n\\n" before a word tokenizes as two newlines).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvrag.errors import EmptyTextError

__all__ = ["PromptLayout", "DEFAULT_SYSTEM_PROMPT"]

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant. Answer the question using the documents."
_SENTINEL = "\x00KVRAG-USER-CONTENT\x00"
_FALLBACK_TEMPLATE = ("{system}\n\n", "\n\nAnswer: ")


@dataclass(frozen=True)
class PromptLayout:
    """Token ids for the fixed parts of a prompt, and the rules for the variable parts."""

    tokenizer: Any
    prefix_ids: tuple[int, ...]
    suffix_ids: tuple[int, ...]
    stop_ids: frozenset[int]

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, system_prompt: str = DEFAULT_SYSTEM_PROMPT) -> "PromptLayout":
        prefix, suffix = _split_template(tokenizer, system_prompt)
        stop = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        for token in ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>", "<|end|>"):
            token_id = tokenizer.convert_tokens_to_ids(token)
            if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
                stop.add(token_id)
        return cls(tokenizer, _ids(tokenizer, prefix), _ids(tokenizer, suffix), frozenset(stop))

    def document_ids(self, text: str) -> list[int]:
        """The ids of one document's segment (without the prefix)."""
        if not text or not text.strip():
            raise EmptyTextError("cannot deposit an empty document; pass text with at least one word")
        return _ids(self.tokenizer, text.rstrip() + "\n")

    def question_ids(self, question: str) -> list[int]:
        """The ids of the final segment: the question and the opening of the assistant turn."""
        if not question or not question.strip():
            raise EmptyTextError("the query is empty; ask a question with at least one word")
        return _ids(self.tokenizer, "Question: " + question.strip()) + list(self.suffix_ids)

    def segment_ids(self, text: str, *, first: bool) -> list[int]:
        """A document's segment as fed to the model: the first one carries the prompt prefix."""
        ids = self.document_ids(text)
        return list(self.prefix_ids) + ids if first else ids


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _split_template(tokenizer: Any, system_prompt: str) -> tuple[str, str]:
    if not getattr(tokenizer, "chat_template", None):
        return _FALLBACK_TEMPLATE[0].format(system=system_prompt), _FALLBACK_TEMPLATE[1]
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
    return _FALLBACK_TEMPLATE[0].format(system=system_prompt), _FALLBACK_TEMPLATE[1]
