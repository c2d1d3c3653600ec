"""User-space probes from the host (``Uprobe``, ``Uretprobe``): the guest's programs and its own uprobes are the oracle.

The probed function is ``syscall()`` of the static ``/bin/workload``, which ``workload getppid N`` calls
exactly N times with ``SYS_getppid`` and whose return value it prints (``ret=``).  Its file offset comes
from the host's copy of the guest tree (the same bytes).  Where the guest kernel has uprobe_events, its
own probe on the same instruction runs in the same VM at the same time: qprobe writes nothing into the
guest, so the kernel's int3 and qprobe's stub breakpoint coexist, and its ``uprobe_profile`` and trace
lines must equal qprobe's counts and values.  Every test ends with the file byte-identical in the guest,
the program's exit status 0 (no SIGTRAP, no crash) and nothing on the console.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import lief
import pytest

import qprobe
from qprobe import Uprobe, Uretprobe, regs_return_value
from qprobe.images.guest import guest_tree

from .conftest import workload_result
from .guest_oracle import TRACING, enable_uprobe_events
from .one_tcg_thread import qprobe_boot_kwargs

pytestmark = pytest.mark.vm
__all__ = ["qprobe_boot_kwargs"]  # a fixture: the guest enables its own events

PROGRAM = "/bin/workload"
SYS_GETPPID = 110  # x86_64's number, what workload passes syscall() for getppid
# A background command of one run() is not the next run()'s job: wait for its summary line instead.
WAIT_SPIN = "while ! grep -q '^workload' /tmp/spin.out 2>/dev/null; do sleep 0.2; done; cat /tmp/spin.out"


def file_offset(tree: Path, path: str, symbol: str) -> int:
    """The file offset of ``symbol`` in the guest's ``path``, from the host's copy of the tree."""
    elf = lief.parse(str(tree / path.lstrip("/")))
    assert elf is not None
    return int(elf.virtual_address_to_offset(elf.get_symbol(symbol).value))


@pytest.fixture(scope="module")
def syscall_offset() -> int:
    return file_offset(guest_tree(), PROGRAM, "syscall")


@pytest.fixture
def program(target: qprobe.Target, qprobe_reset: object) -> str:
    """The program's checksum before the test; the test's end checks it again."""
    target.run(f"ls {PROGRAM} >/dev/null").check()  # its dentry in the cache, as a user's shell would have it
    before = target.run(f"md5sum {PROGRAM}").check().output.split()[0]
    yield before
    assert target.run(f"md5sum {PROGRAM}").check().output.split()[0] == before


def has_uprobe_events(target: qprobe.Target) -> bool:
    return target.run(f"test -w {TRACING}/uprobe_events").status == 0


def test_entry_and_return_equal_the_program_and_the_guest_s_own_uprobes(
    target: qprobe.Target, program: str, syscall_offset: int
) -> None:
    args: list[int] = []
    rets: list[tuple[int, int]] = []
    up = Uprobe(PROGRAM, syscall_offset, handler=lambda _up, regs: args.append(regs.di))
    rp = Uretprobe(
        PROGRAM, syscall_offset, ret_handler=lambda _up, func, regs: rets.append((func, regs_return_value(regs)))
    )
    guest = has_uprobe_events(target)
    if guest:
        target.run(f"echo > {TRACING}/trace; echo 'p:uprobes/gsc {PROGRAM}:{syscall_offset:#x} nr=%di:s64' "
                   f"> {TRACING}/uprobe_events; echo 'r:uprobes/gscr {PROGRAM}:{syscall_offset:#x} ret=$retval:s64' "
                   f">> {TRACING}/uprobe_events; echo 1 > {TRACING}/events/uprobes/enable").check()  # fmt: skip
    target.register_uprobe(up)
    target.register_uprobe(rp)
    try:
        res = workload_result(target.run("workload getppid 40").check().output)
    finally:
        target.unregister_uprobe(up)
        target.unregister_uprobe(rp)
    # A process of the file exits and its breakpoint goes with the probes: nothing left in the stub.
    assert not target.uprobes.points
    assert args.count(SYS_GETPPID) == 40 and up.nhit == len(args), args
    ppid = int(res["ret"])
    assert [r for _f, r in rets].count(ppid) == 40 and rp.nreturns == len(rets) == len(args)
    if not guest:
        return
    target.run(f"echo 0 > {TRACING}/events/uprobes/enable").check()
    profile = target.run(f"cat {TRACING}/uprobe_profile").check().output
    trace = target.run(f"cat {TRACING}/trace").check().output
    target.run(f"echo > {TRACING}/uprobe_events").check()
    hits = {m[0]: int(m[1]) for m in re.findall(r"^\s*\S+\s+(gscr?)\s+(\d+)\s*$", profile, re.M)}
    assert hits == {"gsc": len(args), "gscr": len(rets)}, profile
    # Line for line: the kernel's nr= and ret= for the workload's pid are qprobe's values, in order.
    pid = res["pid"]
    kernel_nr = [int(v) for v in re.findall(rf"-{pid}\s.*\bgsc: \(0x[0-9a-f]+\) nr=(-?\d+)", trace)]
    kernel_ret = re.findall(rf"-{pid}\s.*\bgscr: \((0x[0-9a-f]+) <- (0x[0-9a-f]+)\) ret=(-?\d+)", trace)
    assert kernel_nr == args
    assert [(int(f, 16), int(r)) for _at, f, r in kernel_ret] == rets


def test_processes_already_running_and_started_later(target: qprobe.Target, program: str, syscall_offset: int) -> None:
    pids: Counter[int] = Counter()

    def count(_up: Uprobe, regs: qprobe.PtRegs) -> None:
        if regs.di == SYS_GETPPID:
            pids[target.current_task(regs).pid] += 1

    # One process runs before the probe exists (it mapped the file then), one starts after.
    target.run("rm -f /tmp/spin.out; workload spin 3 > /tmp/spin.out 2>&1 &").check()
    up = Uprobe(PROGRAM, syscall_offset, handler=count)
    target.register_uprobe(up)
    try:
        later = workload_result(target.run("workload getppid 25").check().output)
        spin = workload_result(target.run(WAIT_SPIN).check().output)
    finally:
        target.unregister_uprobe(up)
    assert pids[int(later["pid"])] == 25
    running = pids[int(spin["pid"])]
    # It ran before and during: some of its calls were probed, never more than it made.
    assert 0 < running <= int(spin["count"]), (running, spin)


def test_page_cache_eviction_and_reread(target: qprobe.Target, program: str, syscall_offset: int) -> None:
    n = Counter[str]()
    up = Uprobe(
        PROGRAM, syscall_offset, handler=lambda _up, regs: n.update(["getppid"] if regs.di == SYS_GETPPID else [])
    )
    target.register_uprobe(up)
    try:
        target.run("workload getppid 5").check()
        # The file's pages leave the page cache (nothing maps them now) and are read again from the disk
        # or the initramfs: a new page for the same (file, offset).
        target.run("sync; echo 3 > /proc/sys/vm/drop_caches").check()
        target.run("workload getppid 6").check()
    finally:
        target.unregister_uprobe(up)
    assert n["getppid"] == 11


def test_a_copy_replaced_or_deleted_keeps_the_kernel_s_semantics(
    target: qprobe.Target, program: str, syscall_offset: int
) -> None:
    """A probe is on an inode: a file put in its place later is another file; a deleted one still runs."""
    pids: Counter[int] = Counter()
    target.run(f"cp {PROGRAM} /tmp/wl").check()

    def count(_up: Uprobe, regs: qprobe.PtRegs) -> None:
        if regs.di == SYS_GETPPID:
            pids[target.current_task(regs).pid] += 1

    up = Uprobe("/tmp/wl", syscall_offset, handler=count)
    target.register_uprobe(up)
    try:
        first = workload_result(target.run("/tmp/wl getppid 3").check().output)
        # Deleted while a process runs it: that process keeps the inode, and the probe.
        target.run("/tmp/wl spin 2 > /tmp/wl.out 2>&1 & sleep 0.5; rm /tmp/wl; wait").check()
        deleted = workload_result(target.run("cat /tmp/wl.out").check().output)
        # A new file at the path: not the probed inode.
        target.run(f"cp {PROGRAM} /tmp/wl").check()
        other = workload_result(target.run("/tmp/wl getppid 3").check().output)
        # The program's own copy elsewhere is another inode too.
        untouched = workload_result(target.run("workload getppid 2").check().output)
    finally:
        target.unregister_uprobe(up)
        target.run("rm -f /tmp/wl /tmp/wl.out")
    assert pids[int(first["pid"])] == 3
    assert 0 < pids[int(deleted["pid"])] <= int(deleted["count"])
    assert pids[int(other["pid"])] == 0 and pids[int(untouched["pid"])] == 0


def test_unregistered_while_the_program_runs(target: qprobe.Target, program: str, syscall_offset: int) -> None:
    up = Uprobe(PROGRAM, syscall_offset)
    target.register_uprobe(up)
    target.run("rm -f /tmp/spin.out; workload spin 2 > /tmp/spin.out 2>&1 &").check()
    for _ in range(100):  # until the program is in its loop, hitting the probe (its start may take a while)
        if up.nhit >= 10:
            break
        target.wait(0.05)
    target.unregister_uprobe(up)
    assert not target.uprobes.points
    res = workload_result(target.run(WAIT_SPIN).check().output)
    assert up.nhit > 0 and int(res["count"]) >= up.nhit
    assert res["errors"] == "0"


LIB = "/usr/lib/libqpt.so"


def test_a_shared_library_equals_the_guest_s_own_uprobes(target: qprobe.Target, program: str) -> None:
    """``qpt_lib_add(a, b)`` of libqpt.so (mapped at another address in each process), entry and return, in two
    processes of the dynamic uprog at once: qprobe's events and the guest's own uprobe_events on the same
    instructions count the same (uprobe_profile) and print the same lines."""
    if not has_uprobe_events(target):
        pytest.skip("the guest kernel has no uprobe_events (CONFIG_UPROBE_EVENTS)")
    offset = file_offset(guest_tree(), LIB, "qpt_lib_add")
    enable_uprobe_events(target, f"p:uprobes/glib {LIB}:{offset:#x} a=%di:s64 b=%si:s64",
                         f"r:uprobes/glibr {LIB}:{offset:#x} ret=$retval:s64")  # fmt: skip
    entry = target.add_event(f"p:qlib {LIB}:qpt_lib_add a=%di:s64 b=%si:s64")
    ret = target.add_event(f"r:qlibr {LIB}:qpt_lib_add ret=$retval:s64")
    try:
        out = target.run("uprog lib 6 10 1 & uprog lib 4 100 2; wait").check().output
    finally:
        target.remove_events([entry, ret])
        target.run(f"echo 0 > {TRACING}/events/uprobes/enable").check()
    profile = target.run(f"cat {TRACING}/uprobe_profile").check().output
    trace = target.run(f"cat {TRACING}/trace").check().output
    target.run(f"echo > {TRACING}/uprobe_events").check()
    runs = [dict(p.split("=", 1) for p in line.split()[1:] if "=" in p)
            for line in out.splitlines() if line.startswith("uprog mode=lib")]  # fmt: skip
    assert sorted(int(r["calls"]) for r in runs) == [4, 6] and all(r["bad"] == "0" for r in runs), out
    hits = {m[0]: int(m[1]) for m in re.findall(r"^\s*\S+\s+(glibr?)\s+(\d+)\s*$", profile, re.M)}
    assert hits == {"glib": 10, "glibr": 10} == {"glib": entry.nhit, "glibr": ret.nhit}, profile
    for r in runs:  # per process, in order: the kernel's values are qprobe's
        pid = int(r["pid"])
        mine = [h.body.split(") ", 1)[1] for h in entry.hits if h.pid == pid]
        kernel = re.findall(rf"-{pid}\s.*\bglib: \(0x[0-9a-f]+\) (a=-?\d+ b=-?\d+)", trace)
        assert mine == kernel and len(mine) == int(r["calls"]), (mine, kernel)
        mine_ret = [h.body for h in ret.hits if h.pid == pid]
        kernel_ret = re.findall(rf"-{pid}\s.*\bglibr: (\(0x[0-9a-f]+ <- 0x[0-9a-f]+\) ret=-?\d+)", trace)
        assert mine_ret == kernel_ret, (mine_ret, kernel_ret)
