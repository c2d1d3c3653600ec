"""User ELFs built here with gcc: functions, their uprobe file offsets, and the perf/bpftrace/symbolic uprobe forms."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from qprobe.arch.x86_64.arch import X86_64
from qprobe.fetch import parse_definition
from qprobe.kernel.userelf import UserElf, UserElfError
from qprobe.kernel.usyntax import (
    UprobeSyntaxError,
    bpftrace_uprobe_definition,
    perf_uprobe_definition,
    resolve_uprobe_symbols,
)

X86 = X86_64.registers  # the default images' architecture

SOURCE = """
int counter;
__attribute__((noinline)) int add_one(int x) { counter += x; return x + 1; }
static __attribute__((noinline, used)) int twin(int x) { return x * 3; }
int main(int argc, char **argv) { (void)argv; return add_one(argc) + twin(argc); }
"""


def _build(tmp: Path, name: str, *flags: str) -> bytes:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not installed: no ELF to read")
    src = tmp / "prog.c"
    src.write_text(SOURCE)
    out = tmp / name
    proc = subprocess.run([gcc, "-O2", *flags, "-o", str(out), str(src)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"gcc {' '.join(flags)} failed here: {proc.stderr.strip().splitlines()[-1:]}")
    return out.read_bytes()


def _offset_by_objdump(data: bytes, tmp: Path, name: str) -> int | None:
    """The symbol's file offset from binutils' own reading of the file, when objdump is there."""
    objdump = shutil.which("objdump")
    if objdump is None:
        return None
    path = tmp / "copy"
    path.write_bytes(data)
    syms = subprocess.run([objdump, "-t", str(path)], capture_output=True, text=True, check=True).stdout
    vaddr = next(int(line.split()[0], 16) for line in syms.splitlines() if line.split()[-1:] == [name])
    heads = subprocess.run([objdump, "-p", str(path)], capture_output=True, text=True, check=True).stdout.split("\n")
    for i, line in enumerate(heads):
        words = line.split()
        if words[:1] == ["LOAD"]:
            off, va = int(words[2], 16), int(words[4], 16)
            filesz = int(heads[i + 1].split()[1], 16)
            if va <= vaddr < va + filesz:
                return vaddr - va + off
    return None


@pytest.mark.parametrize(("flags", "kind"), [(("-static", "-no-pie"), "exec"), (("-pie", "-fPIE"), "pie"),
                                              (("-shared", "-fPIC"), "shared")])  # fmt: skip
def test_functions_and_their_file_offsets(tmp_path: Path, flags: tuple[str, ...], kind: str) -> None:
    data = _build(tmp_path, "prog", *flags)
    elf = UserElf(data, "/bin/prog")
    assert elf.kind == kind
    assert elf.is_pie == (kind == "pie")
    add_one = elf.functions("add_one")
    assert len(add_one) == 1 and add_one[0].size > 0
    offset = elf.resolve("add_one")
    assert offset == add_one[0].offset
    expected = _offset_by_objdump(data, tmp_path, "add_one")
    if expected is not None:
        assert offset == expected
    assert elf.resolve("add_one+1") == offset + 1
    assert {f.name for f in elf.functions("[at]*")} >= {"add_one", "twin"}
    assert elf.file_offset(add_one[0].vaddr) == offset


def test_resolution_errors(tmp_path: Path) -> None:
    elf = UserElf(_build(tmp_path, "prog", "-pie", "-fPIE"), "/bin/prog")
    size = elf.functions("add_one")[0].size
    for spec, words in [("nosuch", "no function 'nosuch'"), (f"add_one+{size}", "past its end"),
                        ("add_one+zz", "is not a number")]:  # fmt: skip
        with pytest.raises(UserElfError, match=words) as info:
            elf.resolve(spec)
        assert "\n" not in str(info.value)
    with pytest.raises(UserElfError, match="not an ELF"):
        UserElf(b"#!/bin/sh\n", "/bin/script")


def test_the_translations(tmp_path: Path) -> None:
    elf = UserElf(_build(tmp_path, "prog", "-static", "-no-pie"), "/bin/prog")
    off = elf.resolve("add_one")

    def resolve(path: str, spec: str) -> int:
        assert path == "/bin/prog"
        return elf.resolve(spec)

    def resolved(text: str) -> str:
        out = resolve_uprobe_symbols(parse_definition(text), resolve)
        assert out.words == parse_definition(out.text).words  # the words rewritten as a parse of the text has them
        return out.text

    assert resolved("p:e /bin/prog:add_one+2%return x=%di") == f"p:e /bin/prog:{off + 2:#x}%return x=%di"
    assert resolved("p /bin/prog:0x10(0x8)") == "p /bin/prog:0x10(0x8)"
    assert resolved("p:e /bin/prog:add_one(0x8)") == f"p:e /bin/prog:{off:#x}(0x8)"
    assert perf_uprobe_definition("/bin/prog", "add_one %di n=%si:u32", resolve, X86) == (
        f"p:probe_prog/add_one /bin/prog:{off:#x} %di n=%si:u32"
    )
    assert perf_uprobe_definition("/bin/prog", "ev=add_one%return $retval", resolve, X86) == (
        f"r:probe_prog/ev /bin/prog:{off:#x} $retval"
    )
    with pytest.raises(UprobeSyntaxError, match="DWARF"):
        perf_uprobe_definition("/bin/prog", "add_one x", resolve, X86)
    with pytest.raises(UprobeSyntaxError, match="lines need DWARF"):
        perf_uprobe_definition("/bin/prog", "add_one:3", resolve, X86)
    assert bpftrace_uprobe_definition("uprobe:/bin/prog:add_one", ["arg0", "arg6", "comm", "pid"], resolve, X86) == (
        f"p:uprobes/add_one /bin/prog:{off:#x} arg0=%di:u64 arg6=+8(%sp):u64 comm=$comm"
    )
    assert bpftrace_uprobe_definition("uretprobe:/bin/prog:add_one", ["retval"], resolve, X86) == (
        f"r:uprobes/add_one__return /bin/prog:{off:#x} retval=$retval:u64"
    )
    for probe, vars_, words in [("uretprobe:/bin/prog:add_one", ["arg0"], "not in uretprobes"),
                                ("uprobe:/bin/prog:add_one", ["retval"], "uretprobes only"),
                                ("uprobe:/bin/prog:add_one", ["nsecs"], "fetches arg0"),
                                ("kprobe:vfs_read", [], "expected uprobe")]:  # fmt: skip
        with pytest.raises(UprobeSyntaxError, match=words):
            bpftrace_uprobe_definition(probe, vars_, resolve, X86)
