"""The cache is the user's alone: created 0700, refused when others could write to it, no links followed."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from qprobe.paths import UnsafeCache, cache_dir, read_private, write_private
from qprobe.vmm.journal import Journal, Patch

INT3 = Patch(0x1000, 0xFFFF_FFFF_8100_1000, b"\x55", b"\xcc", "int3")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("QPROBE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_created_private(cache: Path) -> None:
    assert cache_dir("journal") == cache / "journal"
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert stat.S_IMODE((cache / "journal").stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702, 0o1777])
def test_a_cache_others_can_write_is_refused(cache: Path, mode: int) -> None:
    cache.mkdir()
    cache.chmod(mode)
    with pytest.raises(UnsafeCache, match="writable by others") as e:
        cache_dir("symbols")
    assert "\n" not in str(e.value) and "chmod 700" in str(e.value)
    assert not (cache / "symbols").exists()


def test_a_subdirectory_others_can_write_is_refused(cache: Path) -> None:
    (cache / "journal").mkdir(parents=True, mode=0o700)
    (cache / "journal").chmod(0o777)
    with pytest.raises(UnsafeCache, match="writable by others"):
        cache_dir("journal")


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another user needs root")
def test_a_cache_owned_by_someone_else_is_refused(cache: Path) -> None:
    cache.mkdir(mode=0o700)
    os.chown(cache, 65534, 65534)
    with pytest.raises(UnsafeCache, match="belongs to uid 65534"):
        cache_dir()


def test_a_symlinked_subdirectory_is_refused(cache: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    cache.mkdir(mode=0o700)
    (cache / "journal").symlink_to(elsewhere)
    with pytest.raises(UnsafeCache, match="symbolic link"):
        cache_dir("journal")


@pytest.mark.parametrize("kind", ["a file", "under a file", "unwritable"])
def test_an_unusable_cache_is_a_one_line_error(cache: Path, tmp_path: Path, kind: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    target = {"a file": tmp_path / "file", "under a file": tmp_path / "file" / "sub", "unwritable": Path("/proc/qp")}
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("QPROBE_CACHE", str(target[kind]))
    with pytest.raises(UnsafeCache) as e:
        cache_dir("symbols")
    assert "\n" not in str(e.value) and str(target[kind]) in str(e.value)


def test_files_are_never_written_or_read_through_a_link(cache: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("the user's file")
    planted = cache_dir("x") / "data"
    planted.symlink_to(victim)
    with pytest.raises(UnsafeCache, match="symbolic link"):
        read_private(planted)
    write_private(planted, b"new")  # replaces the link itself
    assert victim.read_text() == "the user's file" and not planted.is_symlink() and planted.read_bytes() == b"new"
    assert stat.S_IMODE(planted.stat().st_mode) == 0o600


@pytest.mark.parametrize("which", ["snapshot", "temporary", "log"])
def test_the_journal_never_writes_through_a_planted_link(cache: Path, tmp_path: Path, which: str) -> None:
    victim = tmp_path / "victim"
    victim.write_text("the user's file")
    j = Journal("id")
    link = {"snapshot": j.path, "temporary": j.path.with_suffix(".tmp"), "log": j.log_path}[which]
    link.symlink_to(victim)
    with pytest.raises(UnsafeCache, match="symbolic link"):
        if which == "log":
            j.record_often(INT3)
        elif which == "snapshot":
            j.load()
        else:
            j.record(INT3)
    assert victim.read_text() == "the user's file"


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_a_symbol_cache_or_journal_owned_by_someone_else_is_refused(cache: Path) -> None:
    """Planted by whoever could write there before: its data is not used, and the user is told."""
    table = cache_dir("symbols") / "0123.json"
    write_private(table, b"{}")
    os.chown(table, 65534, 65534)
    with pytest.raises(UnsafeCache, match="belongs to uid 65534, not to you") as e:
        read_private(table)
    assert "\n" not in str(e.value)
    journal = Journal("vm-x")
    journal.record(INT3)
    os.chown(journal.path, 65534, 65534)
    with pytest.raises(UnsafeCache, match="belongs to uid 65534"):
        Journal("vm-x").load()


def test_a_cached_kernel_is_never_read_through_a_link(cache: Path, tmp_path: Path) -> None:
    """The release directory and each kernel file: a link planted in the cache is refused, not followed."""
    from qprobe.images import debian

    real = tmp_path / "elsewhere" / "6.1.0-99-cloud-amd64"
    real.mkdir(parents=True)
    for name in ("vmlinuz", "config", "vmlinux", "System.map"):
        (real / f"{name}-6.1.0-99-cloud-amd64").write_bytes(b"x")
    (real / debian._STAMP).write_text('{"version": "6.1.999-1"}')
    kernels = cache_dir("kernels")
    (kernels / real.name).symlink_to(real)
    with pytest.raises(UnsafeCache, match="symbolic link"):
        debian.cached_kernel("cloud-amd64")
    (kernels / real.name).unlink()
    (kernels / real.name).mkdir()
    for f in real.iterdir():
        (kernels / real.name / f.name).symlink_to(f)
    with pytest.raises(UnsafeCache, match="symbolic link"):
        debian.cached_kernel("cloud-amd64")
