"""The disk tier under a hostile writer of its folder: FIFOs, directories, files cut mid-read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from kvrag import DiskStore, StoreError

from ..conftest import DOC_A, QUESTION
from .conftest import DEADLINE_S, MODEL_MARGIN_S, engine, text_logits, timed


def _path(tmp_path, key):
    return tmp_path / "states" / key[:2] / f"{key}.kvstate"


def test_a_fifo_named_like_a_state_never_blocks(tmp_path):
    victim = engine(f"disk://{tmp_path}")
    ref = victim.deposit(DOC_A)
    path = _path(tmp_path, ref.key)
    path.unlink()
    os.mkfifo(path)
    answer, took = timed(lambda: victim.generate(QUESTION, states=[ref], max_new_tokens=1))
    assert took < DEADLINE_S + MODEL_MARGIN_S
    assert answer.receipt.states[0].reason == "integrity" and "regular file" in answer.receipt.states[0].detail
    assert answer.receipt.first_token_logits_sha256 == text_logits()
    listed = subprocess.run([sys.executable, "-m", "kvrag.cli", "ls", "--store", f"disk://{tmp_path}", "--json"],
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and json.loads(listed.stdout) == []  # skipped, with one line saying so
    assert [line for line in listed.stderr.splitlines() if line.strip()] == [
        f"kvrag: warning: skipped {path.name} in disk://{tmp_path}: not a state file"]


def test_a_directory_named_like_a_state_is_a_miss(tmp_path):
    victim = engine(f"disk://{tmp_path}")
    ref = victim.deposit(DOC_A)
    path = _path(tmp_path, ref.key)
    path.unlink()
    path.mkdir()
    answer = victim.generate(QUESTION, states=[ref], max_new_tokens=1)
    assert answer.receipt.mode == "text-prefill" and answer.receipt.states[0].reason == "integrity"
    assert "regular file" in answer.receipt.states[0].detail


def test_a_state_truncated_and_rewritten_in_place_while_read_is_a_miss_never_sigbus(tmp_path):
    victim = engine(f"disk://{tmp_path}")
    ref = victim.deposit(DOC_A)
    path = _path(tmp_path, ref.key)
    genuine = path.read_bytes()
    stop = threading.Event()

    def rewrite_in_place():
        while not stop.is_set():
            with open(path, "r+b") as f:  # the same inode: what a mapping would SIGBUS on
                f.truncate(len(genuine) // 3)
                f.seek(0)
                f.write(genuine)

    writer = threading.Thread(target=rewrite_in_place)
    writer.start()
    try:
        modes = {victim.generate(QUESTION, states=[ref], max_new_tokens=1, memo=False).receipt.first_token_logits_sha256
                 for _ in range(30)}
    finally:
        stop.set()
        writer.join()
    assert modes == {text_logits()}  # every answer, grafted or re-read, has the text's logits


@pytest.mark.parametrize("namespace", ["..", ".", ".hidden", "a/..", "../blobs"])
def test_a_blob_namespace_never_leaves_its_folder(tmp_path, namespace):
    store = DiskStore(tmp_path / "store")
    name = f"{namespace}/{'ab' * 32}"
    for call in (lambda: store.put_blob(name, b"x"), lambda: store.get_blob(name), lambda: store.delete_blob(name)):
        with pytest.raises(StoreError, match="invalid blob name"):
            call()
    assert not any(p.is_file() for p in tmp_path.rglob("*"))  # nothing written anywhere


@pytest.mark.parametrize("key", ["ab" * 32 + "\n", "ab" * 32 + "\n" + "cd", "AB" * 32, "ab" * 31, "ab" * 32 + " "])
def test_a_key_that_is_not_exactly_64_hex_characters_is_refused(tmp_path, key):
    store = DiskStore(tmp_path)
    with pytest.raises(StoreError, match="invalid state key"):
        store.put(key, b"{}", b"")
    with pytest.raises(StoreError, match="invalid state key"):
        store.read(key)
    assert not (tmp_path / "states").exists()
