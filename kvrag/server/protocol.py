"""The OpenAI wire format, as `kvrag serve` speaks it: typed requests in, typed responses, chunks
and errors out.

Requests are validated here (pydantic), so the server only ever sees well-formed input. A field
kvrag does not know, in the request or inside a message, is refused with a 400 that names it; so
is a known field kvrag cannot honour (several choices, log-probabilities, tools, penalties) set to
anything but the value that asks for nothing. Accepted and ignored on purpose, because they change
nothing kvrag computes: `IGNORED_FIELDS` (request) and `IGNORED_MESSAGE_FIELDS` (message). Two
things are kvrag's own:

- the `kvrag` request field (the OpenAI client's `extra_body={"kvrag": {...}}`): documents to
  read before the conversation, each as text or `{"text", "state_key"}` (what kvrag's retrievers
  stamp), and switches for grafting, depositing and the memo;
- the `kvrag_receipt` response field, beside usage's `prompt_tokens_details.cached_tokens` (the
  tokens grafted from stored states, as OpenAI reports its own prompt cache).

Decoding is greedy unless `temperature` > 0 (OpenAI's default is 1.0; kvrag's is 0, so that an
answer is exact, reproducible and memoizable unless sampling is asked for).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvrag.core.decoding import Generation
from kvrag.core.options import RAG_DEFAULTS, GenerationOptions, Order
from kvrag.core.receipt import Receipt

__all__ = ["Document", "KVRagOptions", "ChatRequest", "CompletionRequest", "ApiError", "error_body", "Usage",
           "ChatCompletion", "ChatCompletionChunk", "Completion", "RECEIPT_FIELD",
           "IGNORED_FIELDS", "IGNORED_MESSAGE_FIELDS", "UNSUPPORTED_FIELDS"]

#: The response field that carries the receipt.
RECEIPT_FIELD = "kvrag_receipt"
_MAX_STOPS = 4  # as OpenAI
_ROLES = {"developer": "system", "function": "tool"}
#: OpenAI request fields kvrag does not implement, with the values that ask for nothing
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none", "auto"),
    "function_call": (None, "none", "auto"), "parallel_tool_calls": (None,),
    "response_format": (None, {"type": "text"}), "logit_bias": (None, {}), "echo": (None, False),
    "best_of": (None, 1), "suffix": (None, ""), "top_logprobs": (None, 0), "audio": (None,),
    "modalities": (None, ["text"]), "prediction": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,),
}
#: Request fields accepted and ignored on purpose: they label or route a request, nothing more.
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier")
#: Message fields accepted and ignored on purpose (`name` labels a participant; the prompt is the content).
IGNORED_MESSAGE_FIELDS = ("name",)
#: Message fields an assistant turn may echo back, accepted only empty.
_EMPTY_MESSAGE_FIELDS = ("tool_calls", "function_call", "refusal", "audio")


class ApiError(Exception):
    """An error with OpenAI's shape: HTTP status, `type`, `code` and the offending `param`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, code=self.code, param=self.param)


def error_body(message: str, *, type: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    """`{"error": {...}}` as OpenAI's API returns it (and its clients parse it)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class Document(BaseModel):
    """A document read before the conversation; `state_key` as stamped by kvrag's retrievers."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(min_length=1)
    state_key: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")


class KVRagOptions(BaseModel):
    """The `kvrag` request field."""

    model_config = ConfigDict(extra="forbid")

    #: read in this order, then the conversation's last user message is the question
    documents: list[Document] = Field(default_factory=list, max_length=64)
    #: False: every document and message is read as text (the text-RAG arm of a comparison)
    graft: bool = True
    #: deposit what was read as text, so the next prompt that begins alike grafts it
    deposit: bool = RAG_DEFAULTS.deposit_missing
    #: ...once the same chain was read as text this many times (1: the first)
    admit_after: int = Field(default=RAG_DEFAULTS.admit_after, ge=1, le=1000)
    #: answer a recurring question from its verified memo state
    memo: bool = RAG_DEFAULTS.memo
    #: the order the documents are read in (`kvrag.GenerationOptions.order`); not for a conversation's messages
    order: Order = RAG_DEFAULTS.order

    @field_validator("documents", mode="before")
    @classmethod
    def _texts(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"text": d} if isinstance(d, str) else d for d in value]
        return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    include_obfuscation: bool | None = None  # ignored: kvrag's chunks carry no obfuscation padding


class _Sampling(BaseModel):
    """What chat and completion requests share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=1 << 16)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1 << 16)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=0, lt=1 << 63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool | int | None = None
    kvrag: KVRagOptions = Field(default_factory=KVRagOptions)
    # ignored on purpose (IGNORED_FIELDS)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # not implemented: accepted only at the values that ask for nothing (UNSUPPORTED_FIELDS)
    tools: Any = None
    functions: Any = None
    tool_choice: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None
    logit_bias: Any = None
    echo: Any = None
    best_of: Any = None
    suffix: Any = None
    top_logprobs: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None

    @model_validator(mode="after")
    def _supported(self) -> "_Sampling":
        refuse = {
            "n": self.n != 1,
            "presence_penalty": self.presence_penalty != 0,
            "frequency_penalty": self.frequency_penalty != 0,
            "logprobs": bool(self.logprobs),
        }
        for name, defaults in UNSUPPORTED_FIELDS.items():
            refuse[name] = getattr(self, name) not in defaults
        for name, refused in refuse.items():
            if refused:
                raise ValueError(f"`{name}` is not supported by kvrag serve; leave it at its default")
        if len(self.stops) > _MAX_STOPS or any(not s for s in self.stops):
            raise ValueError(f"`stop` takes up to {_MAX_STOPS} non-empty strings")
        return self

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def limit(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default

    def options(self, default_max_tokens: int) -> GenerationOptions:
        """What the engine runs this request with (the server's `max_tokens` when it names none)."""
        return GenerationOptions(
            max_new_tokens=self.limit(default_max_tokens), stop=tuple(self.stops) or None, graft=self.kvrag.graft,
            deposit_missing=self.kvrag.deposit, memo=self.kvrag.memo, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, seed=self.seed, order=self.kvrag.order,
            admit_after=self.kvrag.admit_after, deposit_in_background=RAG_DEFAULTS.deposit_in_background,
        )


class ChatMessage(BaseModel):
    """A chat message; text parts of a content list are joined."""

    model_config = ConfigDict(extra="forbid")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # ignored on purpose (IGNORED_MESSAGE_FIELDS)
    tool_call_id: str | None = None  # a tool message's id: the content is what the model reads
    tool_calls: Any = None
    function_call: Any = None
    refusal: Any = None
    audio: Any = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        for part in value if isinstance(value, list) else ():
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            unknown = sorted(set(part) - {"type", "text"})
            if unknown:
                raise ValueError(f"unknown field `{unknown[0]}` in a content part: kvrag serve refuses fields it "
                                 "does not implement rather than ignore them")
        return value

    @model_validator(mode="after")
    def _empty(self) -> "ChatMessage":
        for name in _EMPTY_MESSAGE_FIELDS:
            if getattr(self, name) not in (None, [], ""):
                raise ValueError(f"`{name}` in a message is not supported by kvrag serve")
        return self

    def as_kvrag(self) -> dict[str, str]:
        role = _ROLES.get(self.role, self.role)
        if role not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"unknown role {self.role!r}; use system, developer, user, assistant or tool")
        if isinstance(self.content, list):
            return {"role": role, "content": "\n".join(part["text"] for part in self.content)}
        return {"role": role, "content": self.content or ""}


class ChatRequest(_Sampling):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)

    def conversation(self) -> list[dict[str, str]]:
        try:
            return [m.as_kvrag() for m in self.messages]
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from e


class CompletionRequest(_Sampling):
    """`POST /v1/completions`: a base model continues the prompt as given (after its begin-of-text
    token); a chat model reads it as one user message, rendered with its chat template."""

    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def _one(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError("one prompt per request (a list of several is not supported)")
        return value

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


# ---------------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class PromptTokensDetails(BaseModel):
    #: the prompt tokens grafted from stored states (as OpenAI reports its own prompt cache)
    cached_tokens: int


class Usage(BaseModel):
    """OpenAI usage; `prompt_tokens_details.cached_tokens` are the tokens grafted from stored states."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, receipt: Receipt) -> "Usage":
        prompt = receipt.tokens_reused + receipt.tokens_prefilled
        return cls(prompt_tokens=prompt, completion_tokens=receipt.decode_tokens,
                   total_tokens=prompt + receipt.decode_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=receipt.tokens_reused))


class _Response(BaseModel):
    """What every response and chunk carries; its body leaves out the optional top-level fields
    it does not hold (a delta chunk has no usage and no receipt)."""

    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str

    def body(self) -> dict[str, Any]:
        data = self.model_dump(mode="json")
        return {k: v for k, v in data.items() if v is not None or k not in _OPTIONAL_FIELDS}


_OPTIONAL_FIELDS = ("usage", RECEIPT_FIELD)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(_Response):
    """The whole answer of `POST /v1/chat/completions`, its receipt beside it."""

    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    kvrag_receipt: dict[str, Any]

    @classmethod
    def of(cls, id: str, model: str, fingerprint: str, generation: Generation) -> "ChatCompletion":
        choice = ChatChoice(message=AssistantMessage(content=generation.text), finish_reason=generation.finish_reason)
        return cls(id=id, model=model, system_fingerprint=fingerprint, choices=[choice],
                   usage=Usage.of(generation.receipt), kvrag_receipt=generation.receipt.model_dump(mode="json"))


class ChunkChoice(BaseModel):
    index: int = 0
    #: the text delta (`{"content": ...}`; the first chunk also names the role; the closing one is empty)
    delta: dict[str, str]
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionChunk(_Response):
    """One server-sent event of a streamed chat answer: a delta, the closing chunk (finish reason
    and receipt), or the usage-only chunk that `stream_options.include_usage` asks for."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]
    usage: Usage | None = None
    kvrag_receipt: dict[str, Any] | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: None = None


class Completion(_Response):
    """The whole answer of `POST /v1/completions` (also each streamed chunk of one, as OpenAI's)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kvrag_receipt: dict[str, Any] | None = None

    @classmethod
    def of(cls, id: str, model: str, fingerprint: str, generation: Generation) -> "Completion":
        choice = CompletionChoice(text=generation.text, finish_reason=generation.finish_reason)
        return cls(id=id, model=model, system_fingerprint=fingerprint, choices=[choice],
                   usage=Usage.of(generation.receipt), kvrag_receipt=generation.receipt.model_dump(mode="json"))
