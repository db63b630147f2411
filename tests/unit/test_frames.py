"""Property-based fuzzing of the frame layer: nothing escapes but IntegrityError (or a miss)."""

import hashlib
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrag import IntegrityError
from kvrag.stores.redis.frames import assemble, make_frame_table, parse_frame_table, split
from kvrag.stores.redis.writes import _chunking

PAYLOAD = bytes(range(256)) * 40
RECORD, FRAMES = make_frame_table(b'{"manifest": true}', PAYLOAD, frame_bytes=1000)
RECORD_JSON = RECORD.model_dump_json()


def test_split_and_assemble_round_trip():
    assert len(FRAMES) == 11 and RECORD.frame_length(10) == 240
    assert bytes(assemble(RECORD, [bytes(f) for f in FRAMES])) == PAYLOAD
    assert assemble(RECORD, [bytes(f) for f in FRAMES[:-1]] + [None]) is None
    assert [bytes(f) for f in split(PAYLOAD, 4096)][0] == PAYLOAD[:4096]


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=600), st.text(max_size=600)))
def test_random_records(data):
    try:
        parse_frame_table(data)
    except IntegrityError:
        pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.text(max_size=70),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(json.loads(RECORD_JSON))), json_values)
def test_records_with_a_field_replaced(field, value):
    data = json.loads(RECORD_JSON)
    data[field] = value
    try:
        record = parse_frame_table(json.dumps(data))
    except IntegrityError:
        return
    # An accepted record still cannot make the genuine frames assemble into other bytes.
    try:
        result = assemble(record, [bytes(f) for f in FRAMES])
    except IntegrityError:
        return
    assert result is None or bytes(result) == PAYLOAD


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_damaged_frames(data):
    frames = [bytes(f) for f in FRAMES]
    index = data.draw(st.integers(0, len(frames) - 1))
    action = data.draw(st.sampled_from(["flip", "truncate", "extend", "drop", "replace"]))
    if action == "flip":
        pos = data.draw(st.integers(0, len(frames[index]) - 1))
        frame = bytearray(frames[index])
        frame[pos] ^= data.draw(st.integers(1, 255))
        frames[index] = bytes(frame)
    elif action == "truncate":
        frames[index] = frames[index][: data.draw(st.integers(0, len(frames[index]) - 1))]
    elif action == "extend":
        frames[index] += data.draw(st.binary(min_size=1, max_size=10))
    elif action == "drop":
        frames[index] = None
    else:
        frames[index] = data.draw(st.binary(max_size=1100))
    try:
        result = assemble(RECORD, frames)
    except IntegrityError:
        return
    assert result is None or hashlib.sha256(result).hexdigest() == RECORD.payload_sha256


def test_a_frame_table_lists_the_manifests_digests_where_given_and_digests_the_frames_otherwise():
    digests = [hashlib.sha256(bytes(frame)).hexdigest() for frame in FRAMES]
    assert list(RECORD.frames) == digests
    listed = ["ab" * 32] * len(FRAMES)
    assert list(make_frame_table(b"{}", PAYLOAD, 1000, listed)[0].frames) == listed
    assert list(make_frame_table(b"{}", PAYLOAD, 1000, listed[:-1])[0].frames) == digests  # another count


@settings(max_examples=300, deadline=None)
@given(st.one_of(json_values, st.fixed_dictionaries({"payload_chunk_bytes": json_values, "payload_chunks": json_values}),
                 st.fixed_dictionaries({"payload_chunk_bytes": st.integers(-5, 1 << 31),
                                        "payload_chunks": st.lists(st.sampled_from(["ab" * 32, "AB" * 32, "ab", 7]))})))
def test_a_writer_takes_a_manifests_chunking_only_where_well_formed(fields):
    size, digests = _chunking(json.dumps(fields).encode(), 777)
    declared = fields.get("payload_chunk_bytes") if isinstance(fields, dict) else None
    if isinstance(declared, int) and not isinstance(declared, bool) and 1 <= declared <= 1 << 30:
        assert size == declared
    else:
        assert (size, digests) == (777, None)
    assert digests is None or (digests == fields["payload_chunks"] and all(d == "ab" * 32 for d in digests))
