"""`kvrag serve` and the official `openai` client, offline: the second question grafts the first's document.

    python examples/serve_openai.py

Starts `kvrag serve` on a free loopback port (a real server process), asks it twice through the
OpenAI client with a document in the `kvrag` request field, and prints each receipt's mode and the
prompt tokens served from states (`usage.prompt_tokens_details.cached_tokens`). Needs
`pip install "kvrag[examples]"` (the openai client).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from openai import OpenAI

from kvrag.data import sample_docs
from kvrag.testing import KVRagServer


def main(model: str = "smollm2-135m") -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        server = KVRagServer(model=model, store=f"disk://{folder}/states", log=Path(folder) / "serve.log").start()
        try:
            client = OpenAI(base_url=server.url, api_key="-")
            document = sample_docs()[0].text
            rows = []
            for _ in range(2):
                answer = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "Who built the lighthouse?"}], max_tokens=16,
                    extra_body={"kvrag": {"documents": [document]}})
                receipt = answer.model_extra["kvrag_receipt"]
                cached = answer.usage.prompt_tokens_details.cached_tokens
                rows.append({"answer": answer.choices[0].message.content, "mode": receipt["mode"], "cached": cached})
                print(f"{receipt['mode']:12} {cached} prompt tokens from states: {answer.choices[0].message.content}")
            return rows
        finally:
            server.stop()


if __name__ == "__main__":
    main()
