"""Answers to prompts as frameworks format them: a conversation (`chat`, `stream_chat`) or a
completion prompt (`complete`, `stream_complete`), cut by their content into segments that grafted
states cover (`kvrag.core.transcript`); and a conversation deposited ahead of time (`deposit_chat`).
`KVEngine` takes these from `Transcripts`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from typing_extensions import Unpack

from kvrag.core.continuation import Continuation, plan_segments
from kvrag.core.decoding import Generation, GenerationStream
from kvrag.core.options import GenerationOptions, GenerationSettings, options_of
from kvrag.core.schedule import Segment, StateRef
from kvrag.core.transcript import Message, Transcript, messages_of
from kvrag.errors import InputError
from kvrag.stores.deadline import Deadline

if TYPE_CHECKING:
    from kvrag.core.prompt import PromptLayout
    from kvrag.core.schedule import Planner
    from kvrag.core.transcript import Renderer

__all__ = ["Transcripts", "read_as_text"]


class Transcripts:
    """The prompt-form half of `KVEngine` (it supplies what is declared here)."""

    planner: Planner
    renderer: Renderer
    layout: PromptLayout
    deadline_s: float
    depositor: Any
    run: Callable[[Continuation], GenerationStream]
    _then_deposit: Callable[..., GenerationStream]

    def deposit_chat(self, messages: Sequence[Message | dict[str, Any]]) -> list[StateRef]:
        """Deposit a conversation's segments ahead of time (all of them: the next message starts a
        new segment), so the first ask that continues it grafts them."""
        transcript = self.renderer.render(messages_of(messages), generation_prompt=False)
        self.planner.check_length(len(transcript.ids))
        segments = self.planner.chain(transcript.pieces(), self._chat_layout)
        self.depositor.extend(segments)
        return [self.planner.ref(s) for s in segments]


    def chat(self, messages: Sequence[Message | dict[str, Any]], *, options: GenerationOptions | None = None,
             **settings: Unpack[GenerationSettings]) -> Generation:
        """Answer a conversation; see `stream_chat`."""
        return self.stream_chat(messages, options=options, **settings).result()

    def stream_chat(self, messages: Sequence[Message | dict[str, Any]], *, options: GenerationOptions | None = None,
                    **settings: Unpack[GenerationSettings]) -> GenerationStream:
        """Answer a conversation as a framework formats it (OpenAI-style `{"role", "content"}`
        messages; a completion prompt is one user message), token by token.

        The messages are rendered with the model's chat template and cut where their content says
        so (see `kvrag.core.transcript`): every segment a stored state covers is grafted, the rest is
        read as text in the same segments, so the answer is the same either way. With
        `deposit_missing`, the segments read as text are deposited afterwards, and in a
        conversation (one that already holds an assistant turn) so are the last message and this
        answer, so that the next turn grafts everything before its new message. The options are
        `stream`'s; `approximate` and `blend` apply only to documents and a question.
        """
        opts = _exact(options_of(options, dict(settings)))
        checked = messages_of(messages)
        for message in checked:
            self.planner.check_size(message.content)
        transcript = self.renderer.render(checked)
        return self._run_transcript(transcript, self._chat_layout, opts, opts.stops(self.renderer.chat_stops), checked)

    @property
    def _chat_layout(self) -> str:
        return "chat-template" if self.renderer.chat_form == "template" else "plain-chat"

    def complete(self, prompt: str, *, options: GenerationOptions | None = None,
                 **settings: Unpack[GenerationSettings]) -> Generation:
        """Continue a completion prompt; see `stream_complete`."""
        return self.stream_complete(prompt, options=options, **settings).result()

    def stream_complete(self, prompt: str, *, options: GenerationOptions | None = None,
                        **settings: Unpack[GenerationSettings]) -> GenerationStream:
        """Continue a completion prompt (a framework's formatted prompt string, OpenAI's
        `/v1/completions`), token by token. A base model (the `completion` layout) reads it as
        given, after its begin-of-text token, exactly as a stock `model.generate` on
        `tokenizer(prompt)` would (receipt layout `prompt`); a chat model reads it as one user
        message (`stream_chat`). Cut, grafted and deposited as `stream_chat` does."""
        opts = _exact(options_of(options, dict(settings)))
        if self.layout.kind == "chat":
            return self.stream_chat([Message(role="user", content=prompt)], options=opts)
        transcript = self.renderer.render_prompt(self.planner.check_size(prompt))
        return self._run_transcript(transcript, "prompt", opts, opts.stops(()), None)

    def _run_transcript(self, transcript: Transcript, layout: str, opts: GenerationOptions, stop: Sequence[str],
                        messages: list[Message] | None) -> GenerationStream:
        self.planner.check_length(len(transcript.ids))
        *context, feed = self.planner.chain(transcript.pieces(), layout)
        answer = self.run(Continuation(plan_segments(context, graft=opts.graft, prefix=True), feed.ids, opts.max_new_tokens,
                                       stop, deadline=Deadline(self.deadline_s), sampling=opts.sampling, layout=layout))
        if not opts.deposits:
            return answer
        if messages is None:
            return self._then_deposit(answer, lambda generation: context if read_as_text(generation) else [],
                                      "the prompt", opts, context, feed.ids)
        return self._then_deposit(answer, lambda generation: self._turn(messages, context, generation),
                                  "the conversation", opts, context, feed.ids)

    def _turn(self, messages: list[Message], context: list[Segment], generation: Generation) -> list[Segment]:
        """What to deposit after answering a conversation: in one that already holds an assistant
        turn, its segments up to and including this answer; else the context read as text."""
        if any(m.role == "assistant" for m in messages) and generation.text:
            answered = [*messages, Message(role="assistant", content=generation.text)]
            following = self.planner.chain(self.renderer.render(answered, generation_prompt=False).pieces(),
                                           self._chat_layout)
            if [s.key for s in following[: len(context)]] == [s.key for s in context]:
                return following
        return context if read_as_text(generation) else []



def read_as_text(generation: Generation) -> bool:
    """Whether some context segment of the answer was read as text (so there is something to deposit)."""
    return any(use.source != "graft" for use in generation.receipt.states)


def _exact(opts: GenerationOptions) -> GenerationOptions:
    if not opts.exact_only:
        raise InputError("approximate and blend apply to documents and a question (generate, stream); "
                         "a conversation or a prompt is grafted exactly")
    return opts
