"""The patch journal: atomic private JSON under $QPROBE_CACHE, named by the VM, never silently empty."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from qprobe.errors import QprobeError
from qprobe.vmm import journal as journal_mod
from qprobe.vmm.journal import Journal, JournalError, Patch

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


def test_location_follows_qprobe_cache_and_the_vm(cache: Path) -> None:
    j = Journal("3b43fad5-2e00000-0123456789abcdef")
    assert j.path == cache / "journal" / "3b43fad5-2e00000-0123456789abcdef.json"
    assert Journal("a/b c").path.name == "a_b_c.json"
    assert Journal("a-1").path != Journal("a-2").path


def test_record_forget_load_round_trip(cache: Path) -> None:
    j = Journal("buildid-1e00000-x")
    assert j.load() == []
    j.record(PMD)
    j.record(INT3)
    again = Journal("buildid-1e00000-x")
    assert again.load() == [PMD, INT3]
    j.forget(PMD.phys)
    assert again.load() == [INT3]
    j.forget(0xDEAD)  # unknown: nothing changes
    assert again.load() == [INT3]
    j.clear()
    assert not j.path.exists()
    assert again.load() == []
    j.clear()  # clearing twice is fine


def test_meta_round_trip(cache: Path) -> None:
    j = Journal("id")
    assert j.load() == [] and j.left_meta == {}
    j.record(INT3)
    j.set_meta(stub=0xFFFF_FFFF_BFE0_0000, mailboxes=0xFFFF_FFFF_BFE1_0000)
    j.set_meta(stub=0xFFFF_FFFF_BFE0_1000)
    later = Journal("id")
    assert later.load() == [INT3]
    assert later.left_meta == {"stub": 0xFFFF_FFFF_BFE0_1000, "mailboxes": 0xFFFF_FFFF_BFE1_0000}
    assert later.meta == {}  # what an earlier run left is not this run's
    j.clear()
    assert j.meta == {} and later.load() == [] and later.left_meta == {}


def test_journal_without_meta(cache: Path) -> None:
    j = Journal("id")
    j.path.write_text(json.dumps({"identity": "id", "patches": [INT3.to_json()]}))
    assert j.load() == [INT3] and j.left_meta == {}


def test_record_replaces_the_patch_at_the_same_address(cache: Path) -> None:
    j = Journal("id")
    j.record(INT3)
    newer = Patch(INT3.phys, INT3.virt, b"\x55", b"\xcc", "int3", slot=0x40)
    j.record(newer)
    assert j.load() == [newer]


def test_forget_of_an_unknown_patch_does_not_rewrite(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    j = Journal("id")
    j.record(INT3)
    saves: list[int] = []
    monkeypatch.setattr(Journal, "_save", lambda self: saves.append(1))
    j.forget(0x1)
    assert saves == []


def test_private_modes(cache: Path) -> None:
    j = Journal("id")
    j.record(INT3)
    assert mode(j.path) == 0o600
    assert mode(j.path.parent) == 0o700


def test_a_world_readable_journal_becomes_private(cache: Path) -> None:
    j = Journal("id")
    j.path.write_text(json.dumps({"identity": "id", "patches": []}))
    os.chmod(j.path, 0o644)
    j.record(INT3)
    assert mode(j.path) == 0o600


def test_no_temporary_file_is_left(cache: Path) -> None:
    j = Journal("id")
    for p in (INT3, PMD):
        j.record(p)
    j.forget(INT3.phys)
    assert sorted(x.name for x in j.path.parent.iterdir()) == ["id.json"]


def test_a_failed_write_leaves_the_old_journal(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    j = Journal("id")
    j.record(INT3)
    before = j.path.read_bytes()

    def crash(obj: object, f: object) -> None:
        f.write('{"identity": "id", "patches": [')  # type: ignore[attr-defined]
        raise OSError("disk full")

    monkeypatch.setattr(journal_mod.json, "dump", crash)
    with pytest.raises(OSError, match="disk full"):
        j.record(PMD)
    assert j.path.read_bytes() == before
    assert Journal("id").load() == [INT3]


def test_a_journal_naming_another_vm_is_refused(cache: Path) -> None:
    Journal("id").path.write_text(json.dumps({"identity": "other", "patches": [INT3.to_json()]}))
    with pytest.raises(JournalError, match="names another VM"):
        Journal("id").load()


def test_patch_json(cache: Path) -> None:
    assert INT3.to_json() == {"phys": 0x0200_1234, "virt": 0xFFFF_FFFF_8100_1234, "old": "55", "new": "cc",
                              "what": "int3", "slot": 0xFFFF_FFFF_BFE0_0040}  # fmt: skip
    for p in (INT3, PMD):
        assert Patch.from_json(json.loads(json.dumps(p.to_json()))) == p
    # A record from before slots existed.
    assert Patch.from_json({"phys": 1, "virt": 2, "old": "00", "new": "cc", "what": "int3"}).slot == 0


BAD = [
    "",
    "{not json",
    "\x00\x01",
    '{"identity": "id", "patches": [}',
    "[]",
    "null",
    '{"identity": "id"}',
    '{"identity": "id", "patches": [{"phys": 1}]}',
    '{"identity": "id", "patches": [{"phys": "x"}]}',
    '{"identity": "id", "meta": [], "patches": []}',
    '{"identity": "id", "meta": {"stub": Infinity}, "patches": []}',
    '{"identity": "id", "meta": {"stub": -1}, "patches": []}',
    '{"identity": "id", "patches": [{"phys": Infinity, "virt": 2, "old": "00", "new": "cc", "what": "int3"}]}',
    '{"identity": "id", "patches": [{"phys": NaN, "virt": 2, "old": "00", "new": "cc", "what": "int3"}]}',
    '{"identity": "id", "patches": [{"phys": 1e400, "virt": 2, "old": "00", "new": "cc", "what": "int3"}]}',
    '{"identity": "id", "patches": [{"phys": 1, "virt": 18446744073709551616, "old": "00", "new": "cc", "what": "x"}]}',
    '{"identity": "id", "patches": [{"phys": 1, "virt": 2, "old": "0000", "new": "cc", "what": "int3"}]}',
    '{"identity": "id", "patches": [{"phys": 1, "virt": 2, "old": "", "new": "", "what": "int3"}]}',
    '{"identity": "id", "patches": [{"phys": 1, "virt": 2, "old": "zz", "new": "cc", "what": "int3"}]}',
    '{"identity": "id", "patches": [{"phys": true, "virt": 2, "old": "00", "new": "cc", "what": "int3"}]}',
    "[" * 100_000,
]


@pytest.mark.parametrize("content", BAD, ids=range(len(BAD)))
def test_an_unreadable_journal_is_an_error_naming_the_file(cache: Path, content: str) -> None:
    # Never "restored 0": what it lists may still be in the guest's text.
    j = Journal("id")
    j.path.write_text(content)
    with pytest.raises(JournalError) as e:
        j.load()
    assert str(j.path) in str(e.value) and "delete the file" in str(e.value) and "\n" not in str(e.value)


def test_a_journal_that_is_not_a_file_is_an_error(cache: Path) -> None:
    j = Journal("id")
    j.path.mkdir()
    with pytest.raises(QprobeError, match=str(j.path)):
        j.load()


def test_cache_base_is_private(cache: Path) -> None:
    # cache_dir's docstring: "$QPROBE_CACHE or ~/.cache/qprobe, created with
    # mode 0700"; mkdir(parents=True, mode=0o700) applies the mode to the leaf
    # only, so the base is created 0755 under the usual umask.
    Journal("id").record(INT3)
    assert mode(cache) == 0o700


def test_frequent_patches_go_to_an_appended_log_that_load_replays(cache: Path) -> None:
    j = Journal("id")
    j.record(INT3)
    ret = Patch(0x3000, 0xFFFF_C900_0001_3F00, b"\x11" * 8, b"\x22" * 8, "retaddr")
    gone = Patch(0x3008, 0xFFFF_C900_0001_3F08, b"\x33" * 8, b"\x44" * 8, "retaddr")
    j.record_often(ret)
    j.record_often(gone)
    j.forget_often(gone.phys)
    assert j.log_path.exists() and j.log_path.stat().st_mode & 0o777 == 0o600
    # A later qprobe (after a crash) sees the snapshot plus the log.
    patches = Journal("id").load()
    assert sorted(p.phys for p in patches) == [ret.phys, INT3.phys]
    # A torn last line (a crash mid-append) leaves everything before it.
    with open(j.log_path, "a") as f:
        f.write('+{"phys": 1, "virt"')
    assert len(Journal("id").load()) == 2
    # A snapshot write folds the log in; clear() removes both files.
    j.forget(INT3.phys)
    assert not j.log_path.exists() and [p.phys for p in Journal("id").load()] == [ret.phys]
    j.clear()
    assert not j.path.exists() and not j.log_path.exists()


def test_a_log_without_its_snapshot_is_replayed(cache: Path) -> None:
    ret = Patch(0x3000, 0xFFFF_C900_0001_3F00, b"\x11" * 8, b"\x22" * 8, "retaddr")
    Journal("id").record_often(ret)  # the first patch of a session that then died
    assert Journal("id").load() == [ret]


def test_a_log_of_another_vm_or_a_corrupt_line_is_an_error(cache: Path) -> None:
    ret = Patch(0x3000, 0xFFFF_C900_0001_3F00, b"\x11" * 8, b"\x22" * 8, "retaddr")
    j = Journal("id")
    j.record_often(ret)
    text = j.log_path.read_text()
    j.log_path.write_text(text.replace("=id", "=other"))
    with pytest.raises(JournalError, match="another VM"):
        Journal("id").load()
    j.log_path.write_text(text + "+{}\n" + text.splitlines()[1] + "\n")
    with pytest.raises(JournalError, match="line 3"):
        Journal("id").load()


def test_a_new_session_never_appends_to_an_old_log(cache: Path) -> None:
    old = Patch(0x3000, 0xFFFF_C900_0001_3F00, b"\x11" * 8, b"\x22" * 8, "retaddr")
    new = Patch(0x4000, 0xFFFF_C900_0001_4F00, b"\x33" * 8, b"\x44" * 8, "retaddr")
    Journal("id").record_often(old)
    later = Journal("id")  # recovery ran and found nothing to restore (say, the stack had moved on)
    later.record_often(new)
    assert Journal("id").load() == [new]


def test_a_batch_that_changed_nothing_writes_nothing(cache: Path) -> None:
    j = Journal("id")
    with j.batch():
        j.record(INT3)
    assert Journal("id").load() == [INT3]
    j.path.unlink()  # a marker: only a save writes the file again
    with j.batch():  # an optimizer round that placed no jump
        pass
    assert not j.path.exists()
    with j.batch():
        j.forget(INT3.phys)
    assert j.path.exists() and Journal("id").load() == []


def test_journals_of_vms_that_are_gone_are_swept(cache: Path) -> None:
    """A journal names its QEMU as (pid, start time); a start removes those whose QEMU no longer runs."""
    from qprobe.vmm.peer import process_identity

    child = subprocess.Popen(["true"])
    child.wait()  # reaped: its pid names no process now (or, reused, another start time)
    alive = Journal("vm-alive", process_identity(os.getpid()))
    dead = Journal("vm-dead", (child.pid, 1))
    unknown = Journal("vm-unknown")
    for j in (alive, dead, unknown):
        j.record(INT3)
    with dead.batch():
        dead.record(PMD)  # a log beside the snapshot
    dead._append("+{}")  # and one that is still open
    assert dead.log_path.exists()
    assert journal_mod.sweep_journals() == [dead.path]
    assert alive.path.exists() and unknown.path.exists()
    assert not dead.path.exists() and not dead.log_path.exists()
    assert json.loads(alive.path.read_text())["qemu"] == list(process_identity(os.getpid()) or ())
