"""Completion: commands, events, keys and a bisect-based symbol index."""

from __future__ import annotations

import math
import random
import string
from dataclasses import replace
from types import SimpleNamespace
from typing import SupportsIndex

from shell_fakes import make_shell

from qprobe.arch.x86_64.arch import X86_64
from qprobe.shell.prompt import SymbolIndex, candidates, words_before_cursor


def test_words_before_cursor() -> None:
    assert words_before_cursor("count gp b") == (["count", "gp"], "b")
    assert words_before_cursor("count gp ") == (["count", "gp"], "")
    assert words_before_cursor("") == ([], "")


def test_symbol_index_prefixes() -> None:
    idx = SymbolIndex(["vfs_write", "vfs_read", "vfs_readv", "ksys_read", "vfs_read_iter"])
    assert idx.complete("vfs_read") == ["vfs_read", "vfs_read_iter", "vfs_readv"]
    assert idx.complete("vfs_r", limit=2) == ["vfs_read", "vfs_read_iter"]
    assert idx.complete("zz") == [] and len(idx.complete("")) == 5


class Name(str):
    """A symbol name that counts the orderings and prefix tests made on any name."""

    looks = 0

    def __lt__(self, other: str) -> bool:
        Name.looks += 1
        return str.__lt__(self, other)

    def __le__(self, other: str) -> bool:
        Name.looks += 1
        return str.__le__(self, other)

    def __gt__(self, other: str) -> bool:
        Name.looks += 1
        return str.__gt__(self, other)

    def __ge__(self, other: str) -> bool:
        Name.looks += 1
        return str.__ge__(self, other)

    def startswith(self, prefix: str | tuple[str, ...], start: SupportsIndex | None = None,
                   end: SupportsIndex | None = None, /) -> bool:  # fmt: skip
        Name.looks += 1
        return str.startswith(self, prefix, start, end)


def test_symbol_index_is_logarithmic_on_a_kernel_sized_table() -> None:
    # Counted, not timed: a keystroke must look at O(log n) names, never scan or re-sort the table.
    rng = random.Random(1)
    n = 120_000
    names = [Name("".join(rng.choices(string.ascii_lowercase + "_", k=rng.randint(4, 30)))) for _ in range(n)]
    idx = SymbolIndex(names)
    Name.looks = 0
    got = idx.complete("a")
    looks = Name.looks
    matches = sorted(x for x in names if x.startswith("a"))
    assert len(matches) > 300 and got == matches[:300]  # the cap: 300 candidates copied, of thousands
    # Two binary searches: at most ceil(log2(n + 1)) comparisons each, and at least one.
    assert 2 <= looks <= 2 * math.ceil(math.log2(n + 1)), looks


def test_candidates() -> None:
    shell, t, _out = make_shell()
    shell.execute("p:gp __x64_sys_getppid")
    shell.execute("p:rd vfs_read count=%dx:u64")
    idx = SymbolIndex(t.symbols.names())
    assert candidates(shell, idx, "co") == ["count", "count()"]  # bpftrace's spelling too
    assert "hist" in candidates(shell, idx, "h") and "help" in candidates(shell, idx, "h")
    assert candidates(shell, idx, "p:x vfs_r") == ["vfs_read", "vfs_readv"]
    assert candidates(shell, idx, "p vfs_read+") == []
    assert candidates(shell, idx, "sym __x64") == ["__x64_sys_getppid"]
    assert candidates(shell, idx, "count ") == ["gp", "rd"]
    assert candidates(shell, idx, "count rd ") == ["gp", "by", "for", "run"]
    assert candidates(shell, idx, "hist rd by ") == ["count", "$comm", "$pid", "$cpu", "$func", "$event", "$stack"]
    assert candidates(shell, idx, "count gp by $c") == ["$comm", "$cpu"]
    assert candidates(shell, idx, "-:") == ["-:gp", "-:rd"]
    assert candidates(shell, idx, "regs ") == ["0", "1"]
    assert candidates(shell, idx, "p:x vfs_read ret=$re") == ["ret=$retval"]
    assert candidates(shell, idx, "count gp run wor") == []


def test_a_fetch_argument_completes_with_the_target_architecture_s_registers() -> None:
    shell, t, _out = make_shell()
    idx = SymbolIndex(t.symbols.names())
    assert candidates(shell, idx, "p:x vfs_read a=%") == [
        f"a=%{r}" for r in ("di", "si", "dx", "cx", "r8", "r9", "ax", "sp")
    ]
    assert candidates(shell, idx, "p:x vfs_read a=+0(") == ["a=+0(%di)", "a=+0(%si):string", "a=+0(%si):ustring"]
    # Another architecture's: its argument registers, the first of which returns the value, and its sp.
    t.arch = SimpleNamespace(registers=replace(X86_64.registers, arg_regs=("x0", "x1", "x2"), retval="x0"))
    assert candidates(shell, idx, "p:x vfs_read a=%") == ["a=%x0", "a=%x1", "a=%x2", "a=%sp"]
    assert candidates(shell, idx, "p:x vfs_read a=+0(") == ["a=+0(%x0)", "a=+0(%x1):string", "a=+0(%x1):ustring"]
