"""Ingesting a corpus: every document its own verified state, resumable, in disjoint shards."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvrag import InputError, KVEngine
from kvrag.apps.ingest import CorpusDocument, Shard, ingest, read_corpus
from kvrag.cli import app

from ..conftest import DOC_A, DOC_B, DOC_C, tiny


def corpus_folder(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "more").mkdir(parents=True)
    (folder / "a.txt").write_text(DOC_A)
    (folder / "more" / "b.md").write_text(DOC_B)
    (folder / "c.txt").write_text(DOC_C)
    (folder / "notes.pdf").write_bytes(b"%PDF not a text document")
    return folder


def test_a_folder_and_a_jsonl_file_read_as_the_same_documents(tmp_path):
    folder = corpus_folder(tmp_path)
    documents = read_corpus(folder)
    assert [d.id for d in documents] == ["a.txt", "c.txt", "more/b.md"]
    lines = tmp_path / "docs.jsonl"
    lines.write_text("\n".join(json.dumps({"id": d.id, "text": d.text, "title": "kept"}) for d in documents) + "\n\n")
    assert read_corpus(lines) == documents
    lines.write_text('{"id": "x", "text": "fine"}\n{"id": "y"}\n')
    with pytest.raises(InputError, match=":2 "):
        read_corpus(lines)
    lines.write_text('{"id": "x", "text": "one"}\n{"id": "x", "text": "two"}\n')
    with pytest.raises(InputError, match="names two documents"):
        read_corpus(lines)
    with pytest.raises(InputError, match="neither"):
        read_corpus(tmp_path / "absent")


def test_an_ingest_resumes_and_reports_what_it_could_not_deposit(tmp_path):
    engine = KVEngine(tiny("llama"), f"disk://{tmp_path / 'states'}")
    documents = [CorpusDocument("a", DOC_A), CorpusDocument("empty", "  "), CorpusDocument("b", DOC_B)]
    engine.deposit(DOC_B)  # stored before: an earlier ingest that stopped halfway
    first = ingest(engine, documents)
    assert (first.documents, first.deposited, first.skipped) == (3, 1, 1)
    assert [f.id for f in first.failed] == ["empty"] and "empty" in first.failed[0].error
    assert first.tokens == len(engine.plan([DOC_A])[0].ids) and first.bytes > 0
    again = ingest(engine, documents)
    assert (again.deposited, again.skipped, again.tokens, again.bytes) == (0, 2, 0, 0)
    assert engine.holds(engine.ref(DOC_A)) and engine.holds(engine.ref(DOC_B))
    assert engine.generate("Who built it?", states=[DOC_A], max_new_tokens=1).receipt.mode == "exact-graft"


def test_shards_split_a_corpus_into_disjoint_parts_that_cover_it():
    ids = [f"doc-{i}" for i in range(200)]
    parts = [{i for i in ids if Shard(k, 3).takes(i)} for k in range(3)]
    assert set().union(*parts) == set(ids) and sum(len(p) for p in parts) == len(ids)
    assert all(len(p) > 30 for p in parts)
    assert Shard.parse("2/3") == Shard(2, 3) and all(Shard(0, 1).takes(i) for i in ids)
    for bad in ("3/3", "1", "a/b", "0/0", "-1/2"):
        with pytest.raises(InputError):
            Shard.parse(bad)


def test_deposit_many_deposits_each_text_once(tmp_path):
    engine = KVEngine(tiny("llama"), f"disk://{tmp_path}")
    refs = engine.deposit_many([DOC_A, DOC_B])
    assert refs == [engine.ref(DOC_A), engine.ref(DOC_B)] and all(engine.holds(r) for r in refs)
    stored = sorted(p.stat().st_mtime_ns for p in tmp_path.rglob("*.kvstate"))
    assert engine.deposit_many([DOC_B, DOC_A]) == [refs[1], refs[0]]
    assert sorted(p.stat().st_mtime_ns for p in tmp_path.rglob("*.kvstate")) == stored  # nothing written again


def test_kvrag_ingest_fills_a_store_in_shards_and_resumes(tmp_path):
    folder, store = corpus_folder(tmp_path), f"disk://{tmp_path / 'states'}"
    runner = CliRunner()
    base = ["ingest", str(folder), "--model", "tiny-random-llama", "--store", store, "--json"]
    shards = [json.loads(runner.invoke(app, [*base, "--shard", f"{k}/2"]).stdout) for k in range(2)]
    assert sum(s["documents"] for s in shards) == 3 and sum(s["deposited"] for s in shards) == 3
    done = runner.invoke(app, base)
    assert done.exit_code == 0 and json.loads(done.stdout)["skipped"] == 3
    (folder / "empty.txt").write_text("")
    failed = runner.invoke(app, base)
    assert failed.exit_code == 1 and json.loads(failed.stdout)["failed"][0]["id"] == "empty.txt"
    bad = runner.invoke(app, [*base, "--shard", "2/2"])
    assert bad.exit_code == 2 and "shard" in bad.stderr


def test_a_jsonl_corpus_that_is_not_utf8_is_an_input_error(tmp_path):
    lines = tmp_path / "docs.jsonl"
    lines.write_bytes('{"id": "x", "text": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(InputError, match="not UTF-8"):
        read_corpus(lines)
