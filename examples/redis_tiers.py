"""States in Redis in front of a disk tier, offline: deposit once, graft from the hot tier.

    python examples/redis_tiers.py redis://127.0.0.1:6379/0

Tiers are tried hot first; a copy found in a colder tier is checked, grafted and promoted into the
hotter ones. Each receipt names the tier its state came from. Machines sharing the Redis must share
the signing key (`KVRAG_SIGNING_KEY_FILE`): keys are part of every state's address.
"""

from __future__ import annotations

import sys
import tempfile

from kvrag import KVEngine, load_model
from kvrag.data import sample_docs


def main(redis_url: str = "redis://127.0.0.1:6379/0", model: str = "smollm2-135m") -> list[dict]:
    loaded = load_model(model)
    with tempfile.TemporaryDirectory() as folder:
        store = f"{redis_url},disk://{folder}"
        doc = sample_docs()[0].text
        ref = KVEngine(loaded, store).deposit(doc)           # written to both tiers
        rows = []
        for where in (store, f"disk://{folder}", store):      # hot, cold only, hot again
            answer = KVEngine(loaded, where).generate("Who built the lighthouse?", states=[ref], max_new_tokens=16)
            use = answer.receipt.states[0]
            rows.append({"store": where, "mode": answer.receipt.mode, "tier": use.tier,
                         "logits": answer.receipt.first_token_logits_sha256})
            print(f"{answer.receipt.mode:12} from {use.tier}: {answer.text}")
        return rows


if __name__ == "__main__":
    main(*sys.argv[1:2])
