"""`KVRagLLM`: a LangChain text-completion model (`BaseLLM`) over a `KVEngine`, for pipelines
written for a base model: a `PromptTemplate` piped into an LLM, the prompt string continued as given."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import LLM
from langchain_core.outputs import GenerationChunk
from pydantic import ConfigDict, Field

from kvrag import GenerationStream
from kvrag.apps import RECEIPT_KEY
from langchain_kvrag.engine_fields import KVEngineFields

__all__ = ["KVRagLLM"]


class KVRagLLM(KVEngineFields, LLM):
    """Completion model over a `KVEngine`: the formatted prompt is continued as a stock
    `model.generate` on `tokenizer(prompt)` would continue it (a base model reads it as given; a
    chat model as one user message), every part of it already stored as a verified state is
    grafted, and what was read as text is deposited afterwards (see `KVEngine.stream_complete`), so
    the next prompt that begins alike (the same template over the same documents) grafts it. The
    receipt is in each generation's `generation_info["kvrag_receipt"]`; decoding is greedy unless
    `temperature` > 0."""

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    model_name: str = Field(default="gemma3-270m", alias="model")  # a base model: what a completion model is for

    def _answer(self, prompt: str, stop: list[str] | None, kwargs: dict[str, Any]) -> GenerationStream:
        return self._engine().stream_complete(prompt, options=self._options(stop, kwargs))

    def _call(self, prompt: str, stop: list[str] | None = None,
              run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> str:
        return self._answer(prompt, stop, kwargs).result().text

    def _generate(self, prompts: list[str], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any):  # type: ignore[no-untyped-def]
        from langchain_core.outputs import Generation, LLMResult

        generations = []
        for prompt in prompts:
            generation = self._answer(prompt, stop, kwargs).result()
            info = {"finish_reason": generation.finish_reason, RECEIPT_KEY: generation.receipt.model_dump(mode="json")}
            generations.append([Generation(text=generation.text, generation_info=info)])
        return LLMResult(generations=generations, llm_output={"model_name": self._engine().model.name})

    def _stream(self, prompt: str, stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[GenerationChunk]:
        stream = self._answer(prompt, stop, kwargs)
        for delta in stream:
            chunk = GenerationChunk(text=delta)
            if run_manager:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        assert stream.generation is not None
        yield GenerationChunk(text="", generation_info={"finish_reason": stream.generation.finish_reason,
                                                        RECEIPT_KEY: stream.generation.receipt.model_dump(mode="json")})
