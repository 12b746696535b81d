"""RolloutStore: round trips, cursor, corruption found by record number, torn tails."""

from __future__ import annotations

import warnings

import pytest
import zstandard

from tests.trajectories.hand_trees import compressed_branch
from trajectories.models import Episode
from trajectories.store import RolloutStore, StoreError
from trajectories.testing import episode, session

SUFFIXES = ["jsonl", "jsonl.zst"]


def make(i: int, text: str = "working on it") -> Episode:
    eid = f"ep-{i}"
    return episode(
        [
            session("r", episode_id=eid, text=text),
            session("c1", "r", "compression", episode_id=eid),
        ],
        episode_id=eid,
        sample_id=i,
        reward=float(i % 2),
    )


@pytest.fixture(scope="module")
def many() -> list[Episode]:
    """10,000 real episodes, kept cheap: one session each, every 100th a root and a compression child."""

    def light(i: int) -> Episode:
        eid = f"ep-{i}"
        if i % 100 == 0:
            return make(i)
        return episode([session("r", episode_id=eid)], episode_id=eid, sample_id=i)

    return [light(i) for i in range(10_000)]


@pytest.fixture
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def hashes(episodes) -> list[str]:
    return [e.content_hash for e in episodes]


# --- round trips and cursor ---------------------------------------------------------------


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_round_trip_10000_episodes(tmp_path, many, suffix, no_warnings):
    store = RolloutStore(tmp_path / f"rollouts.{suffix}")
    assert store.compress == suffix.endswith(".zst")
    assert store.cursor == 0 and list(store.read()) == []
    assert store.append(many[:4_000]) == 4_000
    assert store.append(many[4_000:]) == 10_000  # a second append (a second zstd frame)
    assert store.cursor == 10_000 and store.torn_tail == 0
    back = list(store.read())
    assert hashes(back) == hashes(many)
    assert [e.episode_id for e in back] == [f"ep-{i}" for i in range(10_000)]
    assert back[0] == many[0] and back[-1] == many[-1] and back[4_000] == many[4_000]
    assert all(e.hash_ok() for e in back[::997])
    tail = list(store.read(cursor=9_995))
    assert hashes(tail) == hashes(many[9_995:])
    assert list(store.read(cursor=10_000)) == []
    if store.compress:
        raw = store.path.read_bytes()
        assert raw[:4] == b"\x28\xb5\x2f\xfd"  # zstd magic
        assert b"ep-0" not in raw[:200]


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_verify_clean_store(tmp_path, suffix, no_warnings):
    store = RolloutStore(tmp_path / f"r.{suffix}")
    store.append([make(i) for i in range(5)])
    report = store.verify()
    assert report.ok and report.records == 5 and report.errors == [] and report.torn_tail_bytes == 0
    assert str(report) == f"{store.path}: 5 records, 0 bad"


def test_cursor_skips_records(tmp_path, no_warnings):
    store = RolloutStore(tmp_path / "r.jsonl")
    eps = [make(i) for i in range(7)]
    for start in range(0, 7, 3):  # appends of 3, 3, 1
        assert store.append(eps[start:start + 3]) == min(start + 3, 7)
    for k in range(8):
        assert hashes(store.read(cursor=k)) == hashes(eps[k:])
    assert store.append([]) == 7


def test_missing_file_reads_as_empty(tmp_path):
    store = RolloutStore(tmp_path / "absent.jsonl")
    assert store.cursor == 0 and store.torn_tail == 0 and list(store.read()) == []
    assert store.verify().ok
    assert not store.path.exists()


def test_compress_can_be_forced(tmp_path, no_warnings):
    store = RolloutStore(tmp_path / "r.bin", compress=True)
    store.append([make(0)])
    assert store.path.read_bytes()[:4] == b"\x28\xb5\x2f\xfd"
    assert hashes(store.read()) == [make(0).content_hash]


# --- corruption -------------------------------------------------------------------------


def five_with_needle(tmp_path) -> tuple[RolloutStore, list[Episode]]:
    eps = [make(i, text="needle in record three" if i == 2 else "working on it") for i in range(5)]
    store = RolloutStore(tmp_path / "r.jsonl")
    store.append(eps)
    return store, eps


def flip(path, offset: int, mask: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def test_flipped_byte_in_string_value_is_a_hash_mismatch(tmp_path, no_warnings):
    store, eps = five_with_needle(tmp_path)
    data = store.path.read_bytes()
    at = data.index(b"needle")
    assert data.count(b"\n", 0, at) == 2  # it is in record 3
    flip(store.path, at)  # 'n' ^ 1 = 'o': still valid JSON, still a valid episode
    report = store.verify()
    assert not report.ok
    assert report.records == 5
    assert report.errors == [(3, "content_hash mismatch for episode ep-2")]
    assert "record 3: content_hash mismatch" in str(report)
    back = list(store.read())  # read parses; verify is what checks hashes
    assert back[2].sessions[0].turns[1].content == "oeedle in record three"
    assert not back[2].hash_ok()
    assert hashes(back[:2] + back[3:]) == hashes(eps[:2] + eps[3:])


def test_flipped_byte_that_breaks_json_names_the_record(tmp_path, no_warnings):
    store, eps = five_with_needle(tmp_path)
    data = store.path.read_bytes()
    start = data.index(b"\n", data.index(b"\n") + 1) + 1  # start of record 3
    at = data.index(b'"episode_id":', start) + len(b'"episode_id"')
    assert data[at:at + 1] == b":"
    flip(store.path, at, 0x01)  # ':' -> ';'
    report = store.verify()
    assert not report.ok and report.records == 5
    [(number, why)] = report.errors
    assert number == 3
    assert why.startswith("not valid JSON")
    assert "record 3: not valid JSON" in str(report)
    reader = store.read()
    assert hashes([next(reader), next(reader)]) == hashes(eps[:2])
    with pytest.raises(StoreError, match="record 3 is not valid JSON") as info:
        next(reader)
    assert (info.value.record, str(store.path) in str(info.value)) == (3, True)
    assert hashes(store.read(cursor=3)) == hashes(eps[3:])  # later records still readable


def test_valid_json_that_is_not_an_episode(tmp_path, no_warnings):
    store = RolloutStore(tmp_path / "r.jsonl")
    store.append([make(0)])
    with open(store.path, "ab") as fh:
        fh.write(b'{"episode_id": "x"}\n')
    report = store.verify()
    assert [n for n, _ in report.errors] == [2]
    assert report.errors[0][1].startswith("not a valid episode")
    with pytest.raises(StoreError, match="record 2 is not a valid episode"):
        list(store.read())


def test_corrupt_zstd_frame_is_an_error_not_a_torn_tail(tmp_path, no_warnings):
    store = RolloutStore(tmp_path / "r.jsonl.zst")
    store.append([make(i) for i in range(3)])
    first_frame = store.path.stat().st_size
    store.append([make(i) for i in range(3, 5)])
    store.append([make(5)])
    flip(store.path, first_frame + 4, 0xFF)  # the second frame's header
    report = store.verify()
    assert not report.ok
    [(number, why)] = report.errors
    assert number == 4 and f"zstd frame at byte {first_frame} is corrupt" in why
    with pytest.raises(StoreError, match="record 4 onward"):
        list(store.read())
    size = store.path.stat().st_size
    with pytest.raises(StoreError):  # never quarantine good frames behind a corrupt one
        store.append([make(6)])
    assert store.path.stat().st_size == size
    assert not store.path.with_name(store.path.name + ".torn").exists()


@pytest.mark.parametrize("tail", [b"\x00" * 4096, b"\x28\xb5", b"not a frame"])
def test_undecodable_last_zstd_bytes_are_a_torn_tail(tmp_path, tail):
    store = RolloutStore(tmp_path / "r.jsonl.zst")
    store.append([make(i) for i in range(2)])
    with open(store.path, "ab") as fh:
        fh.write(tail)  # e.g. a crash that left zero-filled blocks
    assert store.torn_tail == len(tail) and store.cursor == 2
    with pytest.warns(UserWarning, match="moved a torn tail"):
        store.append([make(2)])
    assert store.path.with_name("r.jsonl.zst.torn").read_bytes() == tail
    assert hashes(store.read()) == hashes([make(i) for i in range(3)])


# --- torn tails -------------------------------------------------------------------------


def torn_store(tmp_path, suffix: str) -> tuple[RolloutStore, list[Episode], bytes, bytes]:
    """A store whose last append was cut mid-record: (store, complete episodes, good bytes, torn)."""
    store = RolloutStore(tmp_path / f"r.{suffix}")
    eps = [make(i) for i in range(6)]
    store.append(eps[:3])
    store.append(eps[3:4])
    good = store.path.read_bytes()
    store.append(eps[4:6])
    data = store.path.read_bytes()
    if store.compress:
        cut = len(good) + (len(data) - len(good)) // 2  # middle of the last frame
    else:
        cut = len(good) + len(eps[4].to_json()) // 2  # middle of record 5
    store.path.write_bytes(data[:cut])
    return store, eps[:4], good, data[len(good):cut]


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_torn_tail_is_ignored_with_a_warning(tmp_path, suffix):
    store, complete, good, torn = torn_store(tmp_path, suffix)
    assert store.torn_tail == len(torn) > 0
    assert store.cursor == 4
    with pytest.warns(UserWarning, match=f"ignoring a torn tail of {len(torn)} bytes"):
        back = list(store.read())
    assert hashes(back) == hashes(complete)
    report = store.verify()
    assert report.ok and report.records == 4 and report.torn_tail_bytes == len(torn)
    assert f"torn tail: {len(torn)} bytes" in str(report)


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_append_after_torn_tail_quarantines_it(tmp_path, suffix):
    store, complete, good, torn = torn_store(tmp_path, suffix)
    quarantine = store.path.with_name(store.path.name + ".torn")
    new = make(100)
    with pytest.warns(UserWarning, match="moved a torn tail"):
        assert store.append([new]) == 5
    assert quarantine.read_bytes() == torn  # moved unchanged
    data = store.path.read_bytes()
    assert data.startswith(good)  # nothing complete rewritten
    rest = data[len(good):]
    if store.compress:
        rest = zstandard.ZstdDecompressor().decompress(rest)
    assert rest == (new.to_json() + "\n").encode()  # the new record alone: never merged
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = list(store.read())
        assert store.torn_tail == 0 and store.verify().ok
    assert hashes(back) == hashes(complete + [new])

    # a second crash: the second torn tail is appended to the same quarantine file
    store.path.write_bytes(data + b"garbage")
    with pytest.warns(UserWarning, match="moved a torn tail of 7 bytes"):
        store.append([make(101)])
    assert quarantine.read_bytes() == torn + b"garbage"
    assert hashes(store.read()) == hashes(complete + [new, make(101)])


def test_cut_on_a_record_boundary_is_not_torn(tmp_path, no_warnings):
    store = RolloutStore(tmp_path / "r.jsonl")
    store.append([make(i) for i in range(3)])
    data = store.path.read_bytes()
    store.path.write_bytes(data[: data.index(b"\n") + 1])
    assert store.torn_tail == 0 and store.cursor == 1


# --- refusing bad input -----------------------------------------------------------------


@pytest.mark.parametrize(
    "forge",
    [
        lambda ep: ep.model_copy(update={"task_id": "other-task"}),
        lambda ep: Episode.model_construct(**{**dict(ep), "content_hash": "0" * 64}),
        lambda ep: Episode.model_construct(**{**dict(ep), "split": "holdout"}),
    ],
)
@pytest.mark.parametrize("suffix", SUFFIXES)
def test_append_refuses_wrong_content_hash(tmp_path, suffix, forge, no_warnings):
    store = RolloutStore(tmp_path / f"r.{suffix}")
    store.append([make(0)])
    before = store.path.read_bytes()
    bad = forge(compressed_branch())
    assert not bad.hash_ok()
    with pytest.raises(StoreError, match="episode ep-0: content_hash does not match"):
        store.append([make(1), bad])
    assert store.path.read_bytes() == before  # nothing of the batch written
    assert store.cursor == 1
