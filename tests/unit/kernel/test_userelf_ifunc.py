"""Indirect functions (STT_GNU_IFUNC) in user ELFs: listed, probed at their resolver by name, and at the
implementation the loader picked by ``NAME@impl``, the pick read from this test's own process, which has the
same files loaded by the host's dynamic loader."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
from ifunc_library import ifunc_library

from qprobe.arch.x86_64.arch import X86_64
from qprobe.fetch import parse_definition
from qprobe.kernel.userelf import LoadedSlots, UserElf, UserElfError
from qprobe.kernel.usyntax import (
    bpftrace_uprobe_definition,
    perf_uprobe_definition,
    render_user_funcs,
    resolve_uprobe_symbols,
    unresolved_syntax,
)

LIBC = Path("/lib/x86_64-linux-gnu/libc.so.6")
X86 = X86_64.registers


def _libc() -> bytes:
    if not LIBC.is_file():
        pytest.skip(f"{LIBC} is absent on this host: no glibc with indirect functions to read")
    return LIBC.read_bytes()


def _bias(path: Path, elf: UserElf) -> int:
    """Where this process has ``path``'s ELF layout: its mapping of file offset 0, less that offset's vaddr."""
    first = elf.vaddr_of(0)
    assert first is not None
    for line in Path("/proc/self/maps").read_text().splitlines():
        words = line.split()
        if len(words) >= 6 and int(words[2], 16) == 0 and os.path.exists(words[5]) and os.path.samefile(words[5], path):
            return int(words[0].split("-")[0], 16) - first
    pytest.skip(f"this test's process has not loaded {path}")


def _this_process(bias: int) -> LoadedSlots:
    """A GOT slot as this process's loader filled it, as core/uprobes reads one in each guest process."""
    return lambda slot: [int.from_bytes(ctypes.string_at(bias + slot, 8), "little") - bias]


def test_a_built_librarys_indirect_function(tmp_path: Path) -> None:
    path = ifunc_library(tmp_path)
    elf = UserElf(path.read_bytes(), "/lib/libifunc.so")
    chosen = elf.functions("chosen")
    assert len(chosen) == 1 and chosen[0].ifunc
    assert not elf.functions("plain")[0].ifunc
    resolver = elf.resolve("chosen")
    assert resolver == chosen[0].offset == elf.functions("pick")[0].offset  # the symbol's value: its resolver
    assert len(elf.irelative_slots(chosen[0].vaddr)) == 1
    assert ctypes.CDLL(str(path)).chosen(1) == 3  # loaded here, pick() having picked plus_two
    bias = _bias(path, elf)
    impl = elf.resolve("chosen@impl", _this_process(bias))
    assert impl == elf.functions("plus_two")[0].offset != resolver
    assert elf.function_at(impl) == "plus_two"
    assert elf.resolve("chosen@impl+1", _this_process(bias)) == impl + 1


def test_impl_refusals(tmp_path: Path) -> None:
    elf = UserElf(ifunc_library(tmp_path).read_bytes(), "/lib/libifunc.so")
    chosen = elf.functions("chosen")[0]
    other = elf.functions("plain")[0].vaddr
    for spec, loaded, words in [("plain@impl", None, "no indirect function"),
                                ("chosen@impl", None, "read from a running process"),
                                ("chosen@impl", lambda slot: [], "no process of the guest maps"),
                                ("chosen@impl", lambda slot: [chosen.vaddr, other], "picked different"),
                                ("chosen@impl", lambda slot: [1 << 40], "in no loaded part")]:  # fmt: skip
        with pytest.raises(UserElfError, match=words) as info:
            elf.resolve(spec, loaded)
        assert "\n" not in str(info.value)


def test_glibc_string_functions_are_listed_and_resolve() -> None:
    elf = UserElf(_libc(), str(LIBC))
    strlen = elf.functions("strlen")
    assert len(strlen) == 1 and strlen[0].ifunc
    assert elf.resolve("strlen") == strlen[0].offset == elf.file_offset(strlen[0].vaddr)
    assert {"strlen", "memcpy", "strchr", "memset"} <= {f.name for f in elf.functions() if f.ifunc}
    assert not elf.functions("getppid")[0].ifunc
    text, summary, _ = render_user_funcs(elf, str(LIBC), ["strlen", "getppid"])
    assert f"0x{strlen[0].offset:08x} {strlen[0].size:8d} strlen [ifunc]\n" in text
    assert text.count("[ifunc]") == 1 and "strlen@impl" not in text and "NAME@impl" in summary


def test_glibc_memcpy_is_its_default_version() -> None:
    elf = UserElf(_libc(), str(LIBC))
    names = {f.name for f in elf.functions("memcpy*")}
    if "memcpy@GLIBC_2.2.5" not in names:
        pytest.skip(f"{LIBC} has no old memcpy@GLIBC_2.2.5 beside its default version")
    default = elf.functions("memcpy")
    assert len(default) == 1 and default[0].ifunc  # the version a program linked now calls: memcpy@@GLIBC_2.14
    assert elf.resolve("memcpy") == default[0].offset != elf.resolve("memcpy@GLIBC_2.2.5")


def test_glibc_strlen_at_the_implementation_this_process_uses() -> None:
    elf = UserElf(_libc(), str(LIBC))
    bias = _bias(LIBC, elf)
    impl = elf.resolve("strlen@impl", _this_process(bias))
    used = ctypes.cast(ctypes.CDLL(str(LIBC)).strlen, ctypes.c_void_p).value  # dlsym runs the resolver too
    assert used is not None and elf.file_offset(used - bias) == impl != elf.resolve("strlen")


def test_the_forms_name_the_implementation() -> None:
    def resolve(path: str, spec: str) -> int:
        return {"strlen": 0x9F1C0, "strlen@impl": 0x1A0F00}[spec]

    assert perf_uprobe_definition(str(LIBC), "strlen@impl %di", resolve, X86) == (
        f"p:probe_libc/strlen_impl {LIBC}:0x1a0f00 %di"
    )
    assert perf_uprobe_definition(str(LIBC), "strlen", resolve, X86) == f"p:probe_libc/strlen {LIBC}:0x9f1c0"
    assert bpftrace_uprobe_definition(f"uprobe:{LIBC}:strlen@impl", ["arg0"], resolve, X86) == (
        f"p:uprobes/strlen_impl {LIBC}:0x1a0f00 arg0=%di:u64"
    )
    assert perf_uprobe_definition(str(LIBC), "strlen@impl%return $retval", resolve, X86) == (
        f"r:probe_libc/strlen_impl__return {LIBC}:0x1a0f00 $retval"
    )
    line = parse_definition(f"r:uq {LIBC}:strlen@impl a=$retval")
    assert resolve_uprobe_symbols(line, resolve).text == f"r:uq {LIBC}:0x1a0f00 a=$retval"
    assert unresolved_syntax(line).text == f"r:uq {LIBC}:{'0' * len('strlen@impl')} a=$retval"  # judged before boot
