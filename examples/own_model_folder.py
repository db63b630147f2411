"""A model folder of your own, offline: load it, deposit, graft.

    python examples/own_model_folder.py [FOLDER]

Any folder `save_pretrained` wrote (config, safetensors weights, tokenizer) loads by its path. With
no argument the embedded smollm2-135m's converted folder stands in for yours. The folder's weights
are hashed into the model fingerprint, so states of another fine-tune never graft here.
"""

from __future__ import annotations

import sys

from kvrag import KVEngine, load_model
from kvrag.data import sample_docs
from kvrag.models.loading import GGUF_MODELS, embedded_folder


def main(folder: str | None = None, dtype: str = "float32") -> dict:
    folder = folder or str(embedded_folder(GGUF_MODELS["smollm2-135m"]))
    model = load_model(folder, dtype=dtype)
    engine = KVEngine(model, "memory://")
    doc = sample_docs()[0].text
    ref = engine.deposit(doc)
    grafted = engine.generate("Who built the lighthouse?", states=[ref], max_new_tokens=16)
    text = engine.generate("Who built the lighthouse?", states=[doc], max_new_tokens=16, graft=False)
    same = grafted.receipt.first_token_logits_sha256 == text.receipt.first_token_logits_sha256
    print(f"{folder}\n{grafted.receipt.mode}: {grafted.text}\nsame logits as re-reading the text: {same}")
    return {"mode": grafted.receipt.mode, "same_logits": same, "fingerprint": model.fingerprint.digest}


if __name__ == "__main__":
    main(*sys.argv[1:2])
