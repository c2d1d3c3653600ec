"""Probes where the kernel's kprobes may not go, on the gdbstub's own breakpoints (``anywhere=True``).

The oracle is the guest: a workload's known number of system calls for
``entry_SYSCALL_64`` (the first instruction of every 64-bit system call, before
``swapgs``), and the guest's own ``exceptions:page_fault_user`` and
``page_fault_kernel`` tracepoints for ``exc_page_fault`` (noinstr), enabled only
while the same command runs.  Kernel text stays byte-identical throughout: a
stub breakpoint writes nothing into the guest.
"""

from __future__ import annotations

import re

import pytest

import qprobe
from qprobe.errors import FetchArgError

from .conftest import workload_result
from .guest_oracle import TRACING

pytestmark = pytest.mark.vm


@pytest.fixture
def text(target: qprobe.Target, qprobe_reset: object) -> dict[str, bytes]:
    """The first 64 bytes of the probed functions, read through the stub before anything is armed."""
    names = ("entry_SYSCALL_64", "exc_page_fault")
    return {n: target.read(n, 64) for n in names}


def _mine(te: qprobe.TraceEvent, pid: str) -> int:
    """Hits of process ``pid`` (from its fork on: before its exec its name is still the shell's)."""
    return sum(1 for h in te.hits if str(h.pid) == pid)


def test_system_call_entry_counts_each_call_before_swapgs(target: qprobe.Target, text: dict[str, bytes]) -> None:
    with pytest.raises(FetchArgError, match=r"notrace function|blacklisted"):
        target.add_event("p:sc entry_SYSCALL_64")  # the kernel's int3 may not go there, nor qprobe's
    te = target.add_event("p:sc entry_SYSCALL_64", anywhere=True)
    try:
        assert target.read("entry_SYSCALL_64", 64) == text["entry_SYSCALL_64"]  # nothing written
        assert "[ANYWHERE]" in target.list_probes()
        counts = {}
        for n in (0, 200):
            res = workload_result(target.run(f"workload getppid {n}").check().output)
            counts[n] = _mine(te, res["pid"])
        # The same program with 200 more getppid calls: 200 more entries, the rest of its calls the same.
        assert counts[200] - counts[0] == 200, counts
        assert counts[0] > 0
    finally:
        target.remove_event(te)
    assert target.read("entry_SYSCALL_64", 64) == text["entry_SYSCALL_64"]


def test_page_faults_equal_the_guest_s_own_tracepoints(target: qprobe.Target, text: dict[str, bytes]) -> None:
    events = f"{TRACING}/events/exceptions"
    if target.run(f"test -d {events}").status != 0:
        pytest.skip("the guest kernel has no exceptions tracepoints")
    te = target.add_event("p:pf exc_page_fault", anywhere=True)
    try:
        target.run(f"echo > {TRACING}/trace").check()
        out = target.run(f"echo 1 > {events}/enable; workload getppid 10; echo 0 > {events}/enable").check().output
        assert target.read("exc_page_fault", 64) == text["exc_page_fault"]
    finally:
        target.remove_event(te)
    pid = workload_result(out)["pid"]
    trace = target.run(f"cat {TRACING}/trace").check().output
    # The trace names a pid by its name when printed, so the child's faults before exec show as workload's too.
    guest = len(re.findall(rf"^\s*\S+-{pid}\s.*\bpage_fault_(?:user|kernel):", trace, re.M))
    assert guest > 0 and _mine(te, pid) == guest, (guest, _mine(te, pid))
    assert target.read("exc_page_fault", 64) == text["exc_page_fault"]


def test_a_function_s_entry_runs_each_call_as_the_workload_asked(target: qprobe.Target) -> None:
    """A function's first instruction (x86's ``__fentry__`` nop, which the host performs instead of stepping):
    every call of the workload's is seen, with its arguments, and each returns what the workload asked for."""
    n = 50
    te = target.add_event("p:ls ksys_lseek fd=%di:s32 off=%si:s64", anywhere=True)
    try:
        res = workload_result(target.run(f"workload lseek {n}").check().output)
    finally:
        target.remove_event(te)
    assert (res["errors"], res["ret"]) == ("0", str(n))  # every lseek returned the offset it asked for
    mine = [h for h in te.hits if str(h.pid) == res["pid"]]
    assert [(h.args["fd"], h.args["off"]) for h in mine] == [(res["fd"], str(i)) for i in range(1, n + 1)]
