"""A uprobe hit whose instruction the host performs is one VM stop, and still what the guest's own uprobes see.

libc's ``getppid`` (``mov eax,0x6e``) and ``malloc`` (``push r12``, a store to the stack) are probed at
entry and return with the Python API while the guest kernel's own uprobe_events probe the same offsets of
the same file: the counts (``uprobe_profile``) and the values (its trace lines: the argument and the return
value, per thread, in order) must be the kernel's and the programs' results unchanged.  Run again without
the kernel's probes (its int3 in the process's copy of the page is an instruction the host leaves to the
step), every hit and return must have been performed on the host, not stepped.  The one step a process may
cost is its first fetch of the probed page, not present yet: that stop is no hit (the fetch faults).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import lief
import pytest

import qprobe
from qprobe import Uprobe, Uretprobe, regs_return_value
from qprobe.images.guest import guest_tree

from .guest_oracle import TRACING
from .one_tcg_thread import qprobe_boot_kwargs

pytestmark = [pytest.mark.vm, pytest.mark.qprobe_needs_config("UPROBE_EVENTS")]
__all__ = ["qprobe_boot_kwargs"]  # a fixture: the guest enables its own events


@pytest.fixture(scope="module")
def libc() -> tuple[str, Path]:
    """The guest's libc.so.6: its path in the guest, and the host's copy of it in the guest tree."""
    tree = guest_tree()
    found = sorted(p for p in tree.rglob("libc.so.6") if p.is_file() and not p.is_symlink())
    assert found, f"no libc.so.6 in {tree}"
    return "/" + found[0].relative_to(tree).as_posix(), found[0]


def offset_of(copy: Path, symbol: str) -> int:
    elf = lief.ELF.parse(str(copy))
    assert isinstance(elf, lief.ELF.Binary)
    sym = elf.get_symbol(symbol)
    assert sym is not None, symbol
    offset = elf.virtual_address_to_offset(sym.value)
    assert isinstance(offset, int)
    return offset


@pytest.fixture
def cached(target: qprobe.Target, qprobe_reset: object, libc: tuple[str, Path]) -> Iterator[str]:
    target.run(f"cat {libc[0]} >/dev/null").check()  # qprobe reads its ELF from the page cache
    before = target.run(f"md5sum {libc[0]}").check().output.split()[0]
    yield libc[0]
    assert target.run(f"md5sum {libc[0]}").check().output.split()[0] == before


Values = dict[int, tuple[list[int], list[int]]]  # thread id -> (entry values, return values)


def _runs(out: str, mode: str) -> list[dict[str, str]]:
    return [dict(p.split("=", 1) for p in line.split()[1:] if "=" in p)
            for line in out.splitlines() if line.startswith(f"uprog mode={mode}")]  # fmt: skip


def _probes(target: qprobe.Target, path: str, offset: int, arg: str) -> tuple[Uprobe, Uretprobe, Values]:
    """An entry probe recording register ``arg`` and a return probe recording the return value, per thread."""
    values: Values = {}

    def entry(_up: Uprobe, regs: qprobe.PtRegs) -> None:
        values.setdefault(target.current_task(regs).pid, ([], []))[0].append(getattr(regs, arg))

    def ret(_up: Uprobe, _func: int, regs: qprobe.PtRegs) -> None:
        values.setdefault(target.current_task(regs).pid, ([], []))[1].append(regs_return_value(regs))

    return Uprobe(path, offset, handler=entry), Uretprobe(path, offset, ret_handler=ret), values


def _run(target: qprobe.Target, probes: tuple[Uprobe, Uretprobe], command: str) -> str:
    for probe in probes:
        target.register_uprobe(probe)
    try:
        return target.run(command).check().output
    finally:
        for probe in probes:
            target.unregister_uprobe(probe)


def _compare(target: qprobe.Target, libc: tuple[str, Path], symbol: str, arg: str, command: str,
             processes: int) -> tuple[str, str, Values]:  # fmt: skip
    """``symbol`` probed at entry and return, with the guest's own uprobe_events beside, then alone.

    Beside the kernel's, the values must be its values; alone (the kernel's int3 in the process's copy
    of the page is an instruction the host leaves to the step), every hit and return must be one stop.
    The command's output with both, and alone, and qprobe's values alone."""
    path = libc[0]
    offset = offset_of(libc[1], symbol)
    up, rp, values = _probes(target, path, offset, arg)
    target.run(f"echo > {TRACING}/trace; echo 'p:uprobes/g1 {path}:{offset:#x} a=%{arg}:x64' > {TRACING}/uprobe_events"
               f"; echo 'r:uprobes/g1r {path}:{offset:#x} ret=$retval:x64' >> {TRACING}/uprobe_events"
               f"; echo 1 > {TRACING}/events/uprobes/enable").check()  # fmt: skip
    try:
        beside = _run(target, (up, rp), command)
    finally:
        target.run(f"echo 0 > {TRACING}/events/uprobes/enable").check()
    profile = target.run(f"cat {TRACING}/uprobe_profile").check().output
    trace = target.run(f"cat {TRACING}/trace").check().output
    target.run(f"echo > {TRACING}/uprobe_events").check()
    hits = {m[0]: int(m[1]) for m in re.findall(r"^\s*\S+\s+(g1r?)\s+(\d+)\s*$", profile, re.M)}
    assert hits == {"g1": up.nhit, "g1r": rp.nreturns} and up.nhit > 0, profile
    for pid, (entries, returns) in values.items():
        kernel = [int(v, 16) for v in re.findall(rf"-{pid}\s.*\bg1: \(0x[0-9a-f]+\) a=(0x[0-9a-f]+)", trace)]
        kernel_ret = [int(v, 16) for v in re.findall(rf"-{pid}\s.*\bg1r: \(.*\) ret=(0x[0-9a-f]+)", trace)]
        assert entries == kernel and returns == kernel_ret, (pid, trace)

    up, rp, values = _probes(target, path, offset, arg)
    um = target.uprobes
    emulated, stepped = um.emulated, um.stepped
    alone = _run(target, (up, rp), command)
    assert up.nhit > 0 and rp.nreturns == up.nhit
    # One stop each: the entry's (both probes on it) and the return's, the host performing the instruction.
    assert um.emulated - emulated == up.nhit + rp.nreturns
    assert um.stepped - stepped <= processes, (um.emulated - emulated, um.stepped - stepped)
    return beside, alone, values


def test_getppid_entry_and_return_are_the_guest_s_and_one_stop_each(
    target: qprobe.Target, cached: str, libc: tuple[str, Path]
) -> None:
    beside, alone, values = _compare(target, libc, "getppid", "di", "uprog getppid 25", processes=1)
    for out in (beside, alone):
        (run,) = _runs(out, "getppid")
        assert run["calls"] == "25" and run["bad"] == "0", out
    (run,) = _runs(alone, "getppid")
    assert values[int(run["pid"])][1] == [int(run["ret"])] * 25  # what the program got, every time


def test_malloc_entry_and_return_are_the_guest_s_and_one_stop_each(
    target: qprobe.Target, cached: str, libc: tuple[str, Path]
) -> None:
    command = "uprog threads 3 4 && uprog call 5 1 2 b"
    beside, alone, values = _compare(target, libc, "malloc", "di", command, processes=2)
    for out in (beside, alone):
        runs = _runs(out, "threads") + _runs(out, "call")
        assert len(runs) == 2 and all(r["bad"] == "0" for r in runs), out
    assert all(len(sizes) == len(ptrs) and all(ptrs) for sizes, ptrs in values.values())  # every call returned
