"""The patch journal: atomic private JSON under $QPROBE_CACHE."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from qprobe.target import journal as journal_mod
from qprobe.target.journal import Journal, Patch

INT3 = Patch(0x0200_1234, 0xFFFF_FFFF_8100_1234, b"\x55", b"\xcc", "int3", slot=0xFFFF_FFFF_BFE0_0040)
PMD = Patch(0x0010_3FF8, 0xFFFF_FFFF_BFE0_0000, bytes(8), (0x1E00_0000 | 0x1E3).to_bytes(8, "little"), "pmd")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("QPROBE_CACHE", str(tmp_path / "cache"))
    old = os.umask(0o022)
    yield tmp_path / "cache"
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_location_follows_qprobe_cache(cache: Path) -> None:
    j = Journal("127.0.0.1:1234", "id")
    assert j.path == cache / "journal" / "127.0.0.1_1234.json"
    assert Journal("unix:/tmp/qprobe 1/gdb.sock", "id").path.name == "unix__tmp_qprobe_1_gdb.sock.json"
    long = Journal("unix:/" + "d/" * 200 + "gdb.sock", "id")
    assert len(long.path.name) == 120 + len(".json") and long.path.name.endswith("gdb.sock.json")
    assert Journal("a:1", "id").path != Journal("a:2", "id").path


def test_record_forget_load_round_trip(cache: Path) -> None:
    j = Journal("127.0.0.1:1234", "buildid:0x1e00000")
    assert j.load() == ("", [])
    j.record(PMD)
    j.record(INT3)
    again = Journal("127.0.0.1:1234", "buildid:0x1e00000")
    assert again.load() == ("buildid:0x1e00000", [PMD, INT3])
    j.forget(PMD.phys)
    assert again.load() == ("buildid:0x1e00000", [INT3])
    j.forget(0xDEAD)  # unknown: nothing changes
    assert again.load() == ("buildid:0x1e00000", [INT3])
    j.clear()
    assert not j.path.exists()
    assert again.load() == ("", [])
    j.clear()  # clearing twice is fine


def test_meta_round_trip(cache: Path) -> None:
    j = Journal("k", "id")
    assert j.load() == ("", []) and j.left_meta == {}
    j.record(INT3)
    j.set_meta(stub=0xFFFF_FFFF_BFE0_0000, mailboxes=0xFFFF_FFFF_BFE1_0000)
    j.set_meta(stub=0xFFFF_FFFF_BFE0_1000)
    later = Journal("k", "id")
    assert later.load() == ("id", [INT3])
    assert later.left_meta == {"stub": 0xFFFF_FFFF_BFE0_1000, "mailboxes": 0xFFFF_FFFF_BFE1_0000}
    assert later.meta == {}  # what an earlier run left is not this run's
    j.clear()
    assert j.meta == {} and later.load() == ("", []) and later.left_meta == {}


def test_journal_without_meta(cache: Path) -> None:
    j = Journal("k", "id")
    j.path.write_text(json.dumps({"identity": "id", "patches": [INT3.to_json()]}))
    assert j.load() == ("id", [INT3]) and j.left_meta == {}


def test_record_replaces_the_patch_at_the_same_address(cache: Path) -> None:
    j = Journal("k", "id")
    j.record(INT3)
    newer = Patch(INT3.phys, INT3.virt, b"\x55", b"\xcc", "int3", slot=0x40)
    j.record(newer)
    assert j.load()[1] == [newer]


def test_forget_of_an_unknown_patch_does_not_rewrite(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    j = Journal("k", "id")
    j.record(INT3)
    saves: list[int] = []
    monkeypatch.setattr(Journal, "_save", lambda self: saves.append(1))
    j.forget(0x1)
    assert saves == []


def test_private_modes(cache: Path) -> None:
    j = Journal("k", "id")
    j.record(INT3)
    assert mode(j.path) == 0o600
    assert mode(j.path.parent) == 0o700


def test_a_world_readable_journal_becomes_private(cache: Path) -> None:
    j = Journal("k", "id")
    j.path.write_text(json.dumps({"identity": "old", "patches": []}))
    os.chmod(j.path, 0o644)
    j.record(INT3)
    assert mode(j.path) == 0o600


def test_no_temporary_file_is_left(cache: Path) -> None:
    j = Journal("k", "id")
    for p in (INT3, PMD):
        j.record(p)
    j.forget(INT3.phys)
    assert sorted(x.name for x in j.path.parent.iterdir()) == ["k.json"]


def test_a_failed_write_leaves_the_old_journal(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    j = Journal("k", "id")
    j.record(INT3)
    before = j.path.read_bytes()

    def crash(obj: object, f: object) -> None:
        f.write('{"identity": "id", "patches": [')  # type: ignore[attr-defined]
        raise OSError("disk full")

    monkeypatch.setattr(journal_mod.json, "dump", crash)
    with pytest.raises(OSError, match="disk full"):
        j.record(PMD)
    assert j.path.read_bytes() == before
    assert Journal("k", "id").load() == ("id", [INT3])


def test_identity_mismatch_is_visible(cache: Path) -> None:
    Journal("k", "buildid-A:0x0").record(INT3)
    later = Journal("k", "buildid-A:0x2000000")
    identity, patches = later.load()
    assert identity == "buildid-A:0x0" != later.identity
    assert patches == [INT3]


def test_patch_json(cache: Path) -> None:
    assert INT3.to_json() == {"phys": 0x0200_1234, "virt": 0xFFFF_FFFF_8100_1234, "old": "55", "new": "cc",
                              "what": "int3", "slot": 0xFFFF_FFFF_BFE0_0040}  # fmt: skip
    for p in (INT3, PMD):
        assert Patch.from_json(json.loads(json.dumps(p.to_json()))) == p
    # A record from before slots existed.
    assert Patch.from_json({"phys": 1, "virt": 2, "old": "00", "new": "cc", "what": "int3"}).slot == 0


@pytest.mark.parametrize("content", ["", "{not json", "\x00\x01", '{"identity": "x", "patches": [}'])
def test_unreadable_journal_is_empty(cache: Path, content: str) -> None:
    j = Journal("k", "id")
    j.path.write_text(content)
    assert j.load() == ("", [])


def test_unreadable_file_is_empty(cache: Path) -> None:
    j = Journal("k", "id")
    j.path.mkdir()  # reading a directory is an OSError
    assert j.load() == ("", [])


@pytest.mark.parametrize(
    "content", ["[]", "null", '{"patches": [{"phys": 1}]}', '{"patches": [{"phys": "x"}]}', '{"meta": []}']
)
def test_journal_of_the_wrong_shape_is_empty(cache: Path, content: str) -> None:
    # Unparsable JSON is treated as no journal; JSON that parses into the
    # wrong shape (another version's format, a hand edit) should be too,
    # rather than an AttributeError/KeyError/ValueError traceback at attach.
    j = Journal("k", "id")
    j.path.write_text(content)
    assert j.load() == ("", [])


def test_cache_base_is_private(cache: Path) -> None:
    # cache_dir's docstring: "$QPROBE_CACHE or ~/.cache/qprobe, created with
    # mode 0700"; mkdir(parents=True, mode=0o700) applies the mode to the leaf
    # only, so the base is created 0755 under the usual umask.
    Journal("k", "id").record(INT3)
    assert mode(cache) == 0o700


def test_frequent_patches_go_to_an_appended_log_that_load_replays(cache: Path) -> None:
    j = Journal("often", "id")
    j.record(INT3)
    ret = Patch(0x3000, 0xFFFF_C900_0001_3F00, b"\x11" * 8, b"\x22" * 8, "retaddr")
    gone = Patch(0x3008, 0xFFFF_C900_0001_3F08, b"\x33" * 8, b"\x44" * 8, "retaddr")
    j.record_often(ret)
    j.record_often(gone)
    j.forget_often(gone.phys)
    assert j.log_path.exists() and j.log_path.stat().st_mode & 0o777 == 0o600
    # A later qprobe (after a crash) sees the snapshot plus the log.
    identity, patches = Journal("often", "id").load()
    assert identity == "id" and sorted(p.phys for p in patches) == [ret.phys, INT3.phys]
    # A torn last line (a crash mid-append) leaves everything before it.
    with open(j.log_path, "a") as f:
        f.write('+{"phys": 1, "virt"')
    assert len(Journal("often", "id").load()[1]) == 2
    # A snapshot write folds the log in; clear() removes both files.
    j.forget(INT3.phys)
    assert not j.log_path.exists() and [p.phys for p in Journal("often", "id").load()[1]] == [ret.phys]
    j.clear()
    assert not j.path.exists() and not j.log_path.exists()
