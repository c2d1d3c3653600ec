"""The newc writer, checked against the system's cpio and the kernel's rules."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from qprobe.errors import ImageError
from qprobe.images.cpio import CpioWriter, extra_files_cpio

needs_cpio = pytest.mark.skipif(shutil.which("cpio") is None, reason="cpio not installed")


def cpio_list(data: bytes) -> list[str]:
    """``cpio -itv`` lines for an archive (GNU cpio reads newc)."""
    proc = subprocess.run(["cpio", "-itv", "--quiet"], input=data, capture_output=True, check=True)
    return proc.stdout.decode().splitlines()


def entries(data: bytes) -> list[tuple[int, str, int, int]]:
    """(offset, name, mode, filesize) of every entry, parsing the format here."""
    out = []
    pos = 0
    while True:
        assert data[pos : pos + 6] == b"070701", f"bad magic at {pos}"
        fields = [int(data[pos + 6 + 8 * i : pos + 14 + 8 * i], 16) for i in range(13)]
        mode, size, namesize = fields[1], fields[6], fields[11]
        name = data[pos + 110 : pos + 110 + namesize - 1].decode()
        out.append((pos, name, mode, size))
        pos += 110 + namesize
        pos += -pos % 4
        pos += size + (-size % 4)
        if name == "TRAILER!!!":
            assert pos == len(data)
            return out


@needs_cpio
def test_writer_round_trip_with_system_cpio(tmp_path: Path) -> None:
    w = CpioWriter()
    w.add_file("/bin/tool", b"#!/bin/sh\necho hi\n", 0o755)
    w.add_symlink("/bin/sh", "/bin/busybox")
    w.add_chardev("/dev/console", 5, 1)
    w.add_dir("/tmp", 0o1777)
    w.add_file("/etc/deep/nested/file.txt", b"x" * 5)
    data = w.finish()
    lines = cpio_list(data)
    by_name = {line.split()[-1] if "->" not in line else line.split()[-3]: line for line in lines}
    assert set(by_name) == {
        "bin",
        "bin/tool",
        "bin/sh",
        "dev",
        "dev/console",
        "tmp",
        "etc",
        "etc/deep",
        "etc/deep/nested",
        "etc/deep/nested/file.txt",
    }
    assert by_name["bin/tool"].startswith("-rwxr-xr-x")
    assert by_name["etc/deep/nested/file.txt"].startswith("-rw-r--r--")
    assert by_name["bin/sh"].startswith("lrwxrwxrwx") and by_name["bin/sh"].endswith("-> /bin/busybox")
    assert by_name["dev/console"].startswith("crw-------")
    assert "5,   1" in by_name["dev/console"] or "5, 1" in by_name["dev/console"]
    assert by_name["tmp"].startswith("drwxrwxrwt")
    assert by_name["etc/deep"].startswith("drwxr-xr-x")
    # Contents survive: extract the regular files only (devices need root).
    out = tmp_path / "x"
    out.mkdir()
    subprocess.run(
        ["cpio", "-idm", "--quiet", "--no-absolute-filenames", "bin/tool", "etc/deep/nested/file.txt"],
        input=data,
        cwd=out,
        check=True,
    )
    assert (out / "bin/tool").read_bytes() == b"#!/bin/sh\necho hi\n"
    assert (out / "etc/deep/nested/file.txt").read_bytes() == b"xxxxx"


def test_layout_is_aligned_and_ends_with_trailer() -> None:
    w = CpioWriter()
    w.add_file("/a", b"123")  # sizes that need padding
    w.add_file("/bb/c", b"12345")
    data = w.finish()
    found = entries(data)
    assert [name for _, name, _, _ in found] == ["a", "bb", "bb/c", "TRAILER!!!"]
    assert all(offset % 4 == 0 for offset, _, _, _ in found)
    assert len(data) % 4 == 0


def test_same_input_gives_same_bytes() -> None:
    def build() -> bytes:
        w = CpioWriter()
        w.add_file("/x/y", b"data", 0o600)
        return w.finish()

    assert build() == build()


def test_writer_rejects_duplicates_and_bad_paths() -> None:
    w = CpioWriter()
    w.add_file("/a/b", b"")
    with pytest.raises(ImageError, match="twice"):
        w.add_file("/a/b", b"")
    with pytest.raises(ImageError, match="also used as a directory"):
        w.add_file("/a/b/c", b"")
    with pytest.raises(ImageError, match=r"\.\."):
        w.add_file("/a/../etc/passwd", b"")


@needs_cpio
def test_extra_files_modes_and_parents(tmp_path: Path) -> None:
    tool = tmp_path / "tool"
    tool.write_bytes(b"\x7fELF...")
    tool.chmod(0o755)
    note = tmp_path / "note.txt"
    note.write_text("hello\n")
    note.chmod(0o600)
    data = extra_files_cpio({"/opt/qprobe/tool": tool, "/root/note.txt": str(note)})
    lines = {line.split()[-1]: line for line in cpio_list(data)}
    assert set(lines) == {"opt", "opt/qprobe", "opt/qprobe/tool", "root", "root/note.txt"}
    assert lines["opt/qprobe/tool"].startswith("-rwxr-xr-x")
    assert lines["root/note.txt"].startswith("-rw-r--r--")
    assert lines["opt"].startswith("drwxr-xr-x")
    assert " root " in lines["opt/qprobe/tool"] or "0        0" in lines["opt/qprobe/tool"]


def test_extra_files_validation(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(ImageError, match="must be absolute"):
        extra_files_cpio({"relative/path": f})
    with pytest.raises(ImageError, match="does not exist"):
        extra_files_cpio({"/x": tmp_path / "missing"})
    with pytest.raises(ImageError, match="not a regular file"):
        extra_files_cpio({"/x": tmp_path})
    with pytest.raises(ImageError, match=r"\.\."):
        extra_files_cpio({"/a/../b": f})
    with pytest.raises(ImageError, match="names no file"):
        extra_files_cpio({"/": f})
