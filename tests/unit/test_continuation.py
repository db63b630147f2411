"""The plan per segment: the engine's policy (`plan_segments`) and what a continuation says of it.
Running a plan is the continuer's (tests/unit/test_reuse.py, test_approximate.py, test_engine.py)."""

from __future__ import annotations

import pytest

from kvrag.core.continuation import Blend, Continuation, Graft, Move, Prefix, Recall, Text, plan_segments
from kvrag.core.schedule import Segment, StateRef

SCOPE = "scope-a"


def segments(n: int) -> list[Segment]:
    out, start, parent = [], 0, None
    for i in range(n):
        out.append(Segment(text=f"doc {i}", ids=[i] * 3, key=f"k{i}", parent_key=parent, start=start))
        start, parent = start + 3, f"k{i}"
    return out


def ref(key: str, scope: str = SCOPE) -> StateRef:
    return StateRef(key=key, parent_key=None, start=0, token_count=3, text="doc", model_fingerprint="m", scope=scope)


def test_each_segment_grafts_its_own_state_and_names_another_ref_put_in_its_place():
    seg = segments(3)
    steps = plan_segments(seg, [ref("k0"), ref("elsewhere"), "doc 2"], scope=SCOPE)
    assert steps == (Graft(seg[0]), Graft(seg[1], ref("elsewhere")), Graft(seg[2]))


@pytest.mark.parametrize("ratio", [None, 0.15])
def test_a_ref_deposited_elsewhere_is_moved_or_blended_only_where_asked_and_only_from_this_scope(ratio):
    seg = segments(3)
    requested = [ref("k0"), ref("elsewhere"), ref("theirs", scope="scope-b")]
    steps = plan_segments(seg, requested, scope=SCOPE, approximate=ratio is None, blend=ratio, rerotate=False)
    moved = Move(seg[1], ref("elsewhere"), rerotate=False) if ratio is None else Blend(seg[1], ref("elsewhere"), ratio, False)
    assert steps == (Graft(seg[0]), moved, Graft(seg[2], ref("theirs", scope="scope-b")))
    assert Continuation(steps, [9], 1).blend == ratio


def test_with_grafting_off_every_segment_is_text_and_nothing_is_read_from_the_store():
    seg = segments(2)
    steps = plan_segments(seg, [ref("k0"), ref("elsewhere")], scope=SCOPE, graft=False, prefix=True, blend=0.5)
    assert steps == (Text(seg[0]), Text(seg[1], requested=ref("elsewhere")))
    assert Continuation(steps, [9], 1).grafts == []


def test_the_longest_stored_prefix_comes_first_where_asked():
    seg = segments(2)
    steps = plan_segments(seg, prefix=True)
    assert steps == (Prefix(), Graft(seg[0]), Graft(seg[1]))
    assert plan_segments([], prefix=True) == ()
    continuation = Continuation(steps, [9, 9], 4)
    assert continuation.context == seg and continuation.prompt_tokens == 8 and not continuation.memo


def test_a_memo_recall_is_its_context_then_a_state_that_must_graft():
    seg = segments(3)
    continuation = Continuation([*plan_segments(seg[:2]), Recall(seg[2])], [9], 2)
    assert continuation.memo and continuation.context == seg and continuation.grafts == seg
    assert continuation.blend is None


def test_the_continuer_runs_the_plan_it_is_given_and_a_recall_that_cannot_graft_fails_the_answer():
    from kvrag import KVEngine, MemoryStore
    from kvrag.errors import StateError
    from tests.conftest import DOC_A, DOC_B, tiny

    engine = KVEngine(tiny("llama"), MemoryStore())
    engine.deposit_chain([DOC_A, DOC_B])
    seg = engine.plan([DOC_A, DOC_B])
    feed = engine.planner.question("Who?", seg)
    answer = engine.run(Continuation([Graft(seg[0]), Text(seg[1], reason="graft-off", detail="asked")], feed, 1)).result()
    assert [(u.source, u.reason) for u in answer.receipt.states] == [("graft", None), ("text", "graft-off")]
    text = engine.run(Continuation(plan_segments(seg, graft=False), feed, 1)).result()
    assert answer.receipt.first_token_logits_sha256 == text.receipt.first_token_logits_sha256
    missing = engine.plan([DOC_A, DOC_B, "Not deposited."])
    with pytest.raises(StateError):
        engine.run(Continuation([*plan_segments(missing[:2]), Recall(missing[2])], feed, 1)).result()
