"""One timeline: hits from every path come out in the order they happened, on the guest's own trace clock."""

from __future__ import annotations

import re

import pytest

import qprobe
from qprobe.events import EventHit

from .conftest import workload_result

pytestmark = pytest.mark.vm

TRACING = "/sys/kernel/tracing"


def _nested(target: qprobe.Target) -> tuple[list[tuple[str, int, float]], int]:
    """ksys_read > vfs_read > its return, as three events; (every hit as delivered, the workload's pid)."""
    seen: list[tuple[str, int, float]] = []

    def note(hit: EventHit) -> None:
        seen.append((hit.event, hit.pid, hit.ts))

    ks = target.add_event("p:ks ksys_read", note)
    vr = target.add_event("p:vr vfs_read count=%dx", note)
    vrr = target.add_event("r:vrr vfs_read ret=$retval", note)
    vr.use_host_handler(True)  # through a mailbox (or a stop) while ks is recorded in the guest
    try:
        res = workload_result(target.run("workload read 20 64").check().output)
    finally:
        for te in (ks, vr, vrr):
            target.remove_event(te)
    return seen, int(res["pid"])


def _check_nesting(seen: list[tuple[str, int, float]], pid: int) -> None:
    mine = [name for name, p, _ in seen if p == pid]
    # The workload's reads are read(2): each is ksys_read, then vfs_read, then vfs_read's return.
    text = " ".join(mine)
    assert text.count("ks vr vrr") >= 20, text
    assert re.fullmatch(r"((ks )?vr vrr ?)+", text + " "), text
    stamps = [ts for _, _, ts in seen]
    assert stamps == sorted(stamps)


def test_entry_and_return_of_nested_functions_come_out_in_order(target: qprobe.Target) -> None:
    seen, pid = _nested(target)
    _check_nesting(seen, pid)


def test_in_order_when_every_hit_is_a_vm_stop(target: qprobe.Target) -> None:
    target.set_kprobes_optimization(False)
    try:
        seen, pid = _nested(target)
    finally:
        target.set_kprobes_optimization(True)
    _check_nesting(seen, pid)


def _guest_stamps(trace: str, event: str, comm: str) -> list[float]:
    """The timestamps of ``event``'s lines in the guest's trace whose task is ``comm``."""
    return [float(m.group(1)) for m in re.finditer(rf"^\s*{comm}-\d+ .*?(\d+\.\d+): {event}:", trace, re.M)]


@pytest.mark.parametrize("optimized", [True, False], ids=["optimized", "vm-stop"])
def test_timestamps_are_the_guests_trace_clock(target: qprobe.Target, optimized: bool) -> None:
    """qprobe's hit and the guest's own kprobe event on the same call carry the same time."""
    if target.clock_note is not None:
        pytest.skip(target.clock_note)
    target.run(f"mount -t tracefs none {TRACING} 2>/dev/null; echo > {TRACING}/trace; "
               f"echo 'p:gseek ksys_lseek' >> {TRACING}/kprobe_events && "
               f"echo 1 > {TRACING}/events/kprobes/gseek/enable").check()  # fmt: skip
    target.set_kprobes_optimization(optimized)
    ev = target.add_event("p:qseek ksys_lseek")
    try:
        target.run("workload lseek 6").check()
    finally:
        target.remove_event(ev)
        target.set_kprobes_optimization(True)
        trace = target.run(f"cat {TRACING}/trace; echo 0 > {TRACING}/events/kprobes/gseek/enable; "
                           f"echo '-:gseek' >> {TRACING}/kprobe_events").check().output  # fmt: skip
    guest_mine = _guest_stamps(trace, "gseek", "workload")
    ours = [h.ts for h in ev.hits if h.comm == "workload"]
    assert len(ours) == len(guest_mine) >= 6
    for q, g in zip(ours, guest_mine, strict=True):
        # The guest's probe runs from ftrace at the function's __fentry__ call, qprobe's at the
        # next instruction: the same call, microseconds apart on one clock (printed to 1 us).
        assert abs(q - g) < 0.002, (ours, guest_mine)
