"""Completion: commands, events, keys and a bisect-based symbol index."""

from __future__ import annotations

import random
import string
import time

from shell_fakes import make_shell

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


def test_symbol_index_is_fast_on_a_kernel_sized_table() -> None:
    rng = random.Random(1)
    names = ["".join(rng.choices(string.ascii_lowercase + "_", k=rng.randint(4, 30))) for _ in range(120_000)]
    idx = SymbolIndex(names)
    t0 = time.perf_counter()
    for _ in range(1000):
        idx.complete("ab")
    assert (time.perf_counter() - t0) / 1000 < 0.002  # per keystroke, with 300 candidates copied


def test_candidates() -> None:
    shell, t, _out = make_shell()
    shell.execute("p:gp __x64_sys_getppid")
    shell.execute("p:rd vfs_read count=%dx:u64")
    idx = SymbolIndex(t.symbols.names())
    assert candidates(shell, idx, "co") == ["count"]
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
