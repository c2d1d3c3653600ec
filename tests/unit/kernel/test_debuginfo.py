"""A vmlinux without debug info: what needs DWARF (or BTF) says so in one line, before a VM boots."""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from qprobe import cli
from qprobe.cli import host, interactive, trace
from qprobe.errors import FetchArgError, SymbolError
from qprobe.fetch.messages import BAD_FETCH_ARG, NOSUP_BTFARG
from qprobe.kernel.debuginfo import has_btf_section, has_dwarf, need_dwarf, section_names
from qprobe.kernel.perfprobe import perf_to_kprobe
from qprobe.kernel.perfsyntax import parse_perf_probe

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("objcopy") is None,
                                reason="needs gcc and objcopy (make setup)")  # fmt: skip


@pytest.fixture
def elves(tmp_path: Path) -> tuple[Path, Path]:
    """An x86-64 ELF file with DWARF, and the same with its debug sections stripped (objcopy, as a user would)."""
    src = tmp_path / "k.c"
    src.write_text("int vfs_read(int fd, long count) { return fd + (int)count; }\n")
    full, stripped = tmp_path / "vmlinux-g", tmp_path / "vmlinux-nodwarf"
    subprocess.run(["gcc", "-g", "-c", "-o", str(full), str(src)], check=True)
    subprocess.run(["objcopy", "--strip-debug", str(full), str(stripped)], check=True)
    return full, stripped


def test_dwarf_is_read_from_the_file(elves: tuple[Path, Path], tmp_path: Path) -> None:
    full, stripped = elves
    assert ".debug_info" in section_names(full) and ".text" in section_names(stripped)
    assert has_dwarf(full) and not has_dwarf(stripped)
    assert not has_btf_section(full)
    (tmp_path / "text").write_text("not an ELF file")
    assert section_names(tmp_path / "text") == frozenset() == section_names(tmp_path / "absent")
    need_dwarf(full, "x")  # no error
    with pytest.raises(SymbolError) as exc:
        need_dwarf(stripped, "a perf probe definition")
    text = str(exc.value)
    assert "\n" not in text and text.startswith("a perf probe definition needs the kernel's debug info, and "
                                                "vmlinux-nodwarf has none")  # fmt: skip
    assert "CONFIG_DEBUG_INFO_DWARF_TOOLCHAIN_DEFAULT=y" in text


def test_a_perf_definition_is_refused_before_gdb(elves: tuple[Path, Path]) -> None:
    """Before: gdb ran and said 'no function vfs_read in vmlinux's debug information', as for a typo."""
    symbols = SimpleNamespace(path=elves[1])
    with pytest.raises(SymbolError, match=r"^a perf probe definition needs the kernel's debug info"):
        perf_to_kprobe([parse_perf_probe("perf vfs_read count")], symbols, None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("argv", "what"),
    [
        (["drgn"], "qprobe drgn (the kernel's types and variables)"),
        # Each hit's pid is read at task_struct's offset of pid: without it no hit is the command's.
        (["trace", "--run", "cat /proc/version", "p:h vfs_read"], "--run (which keeps the hits of the command's"),
    ],
)
def test_refused_before_boot(elves: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str], argv: list[str], what: str) -> None:  # fmt: skip
    monkeypatch.setattr(host, "_host_symbols", lambda args: SimpleNamespace(path=elves[1]))
    for command in (interactive, trace):  # where drgn and trace boot
        monkeypatch.setattr(command, "_boot", lambda *a: pytest.fail("booted"))
    assert cli.main([*argv[:1], "--attach", "unix:/nonexistent", "--vmlinux", str(elves[1]), *argv[1:]]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"{what}" in err[0] and "needs the kernel's debug info" in err[0], err


def test_a_named_argument_says_the_kernel_has_no_btf(elves: tuple[Path, Path],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setattr(host, "_host_symbols", lambda args: SimpleNamespace(path=elves[1]))
    refused = FetchArgError(NOSUP_BTFARG, "p:x vfs_read count", 13)
    told = host._without_btf(argparse.Namespace(), refused)
    assert told.explained == (f"{NOSUP_BTFARG}: vmlinux-nodwarf has no BTF: named arguments need a kernel built "
                              "with CONFIG_DEBUG_INFO_DWARF_TOOLCHAIN_DEFAULT=y and CONFIG_DEBUG_INFO_BTF=y (and "
                              "pahole: BR2_LINUX_KERNEL_NEEDS_HOST_PAHOLE in buildroot)")  # fmt: skip
    assert (told.text, told.column) == (refused.text, refused.column)
    other = FetchArgError(BAD_FETCH_ARG, "p:x vfs_read %zz", 13)
    assert host._without_btf(argparse.Namespace(), other) is other
