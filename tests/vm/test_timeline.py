"""One timeline: hits from every path come out in the order they happened, on the guest's own trace clock."""

from __future__ import annotations

import itertools
import re
import time

import pytest

import qprobe
from qprobe.events import EventHit, TraceEvent

from .conftest import workload_result

pytestmark = pytest.mark.vm

TRACING = "/sys/kernel/tracing"


def _nested(target: qprobe.Target) -> tuple[list[tuple[str, int, float]], int]:
    """ksys_read > vfs_read > its return, as three events; (every hit as printed, the workload's pid)."""
    seen: list[tuple[str, int, float]] = []

    def note(hit: EventHit) -> None:  # as qprobe trace prints: through the target's timeline
        target.timeline.push(hit.order, lambda: seen.append((hit.event, hit.pid, hit.ts)))

    ks = target.add_event("p:ks ksys_read", note)
    vr = target.add_event("p:vr vfs_read count=%dx", note)
    vrr = target.add_event("r:vrr vfs_read ret=$retval", note)
    vr.use_host_handler(True)  # through a mailbox (or a stop) while ks is recorded in the guest
    if target.kprobes_optimization:  # every hit on a path that carries the guest's own TSC
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(_optimized(target, te) for te in (ks, vr, vrr)):
            time.sleep(0.1)
    try:
        res = workload_result(target.run("workload read 20 64").check().output)
    finally:
        for te in (ks, vr, vrr):
            target.remove_event(te)
    return seen, int(res["pid"])


def _optimized(target: qprobe.Target, te: TraceEvent) -> bool:
    probe = te.probe
    kp = probe.kp if isinstance(probe, qprobe.Kretprobe) else probe
    point = target.kprobes.points.get(kp.resolved) if kp is not None else None
    return point is not None and point.opt is not None


def _check_nesting(seen: list[tuple[str, int, float]], pid: int) -> None:
    mine = [name for name, p, _ in seen if p == pid]
    # The workload's reads are read(2): each is ksys_read, then vfs_read, then vfs_read's return.
    text = " ".join(mine)
    assert text.count("ks vr vrr") >= 20, text
    assert re.fullmatch(r"((ks )?vr vrr ?)+", text + " "), text
    # Printed stamps follow the order to within the guest's own clock's step: its "global" clock is
    # its last tick plus sched_clock's advance, and the host converts a ring record after newer ticks.
    stamps = [ts for _, _, ts in seen]
    assert all(later >= earlier - 1e-5 for earlier, later in itertools.pairwise(stamps)), stamps


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


@pytest.mark.parametrize("optimized", [True, False], ids=["optimized", "vm-stop"])
@pytest.mark.qprobe_needs_config("TRACING")  # the guest's own trace clock, read through tracefs
@pytest.mark.qprobe_needs_config("HPET_TIMER")  # a VM stop is timed by the HPET, whose address the kernel keeps
def test_timestamps_are_the_guests_trace_clock(target: qprobe.Target, optimized: bool) -> None:
    """A write to trace_marker, stamped by qprobe's probe and by the guest's own trace, carries one time.

    The guest stamps the marker in tracing_mark_write, microseconds after qprobe's probe at
    ksys_write (tracing_mark_write itself is notrace); no text of the guest's is patched for it,
    as enabling one of its events would.
    """
    target.run(f"mount -t tracefs none {TRACING} 2>/dev/null; echo > {TRACING}/trace").check()
    chosen = re.search(r"\[([\w-]+)\]", target.run(f"cat {TRACING}/trace_clock").check().output)
    assert chosen is not None, "the guest's trace_clock names no clock in brackets"
    if chosen[1] not in ("local", "global", "perf"):  # the clocks qprobe computes (qprobe.kernel.clock)
        pytest.skip(f"the guest's trace clock is {chosen[1]!r}")
    target.set_kprobes_optimization(optimized)
    mark = "qprobe-timeline-marker-0123456789ab"  # with echo's newline, a write of a length nothing else makes
    ev = target.add_event("p:qmark ksys_write count=%dx", filter=f"count == {len(mark) + 1}")
    try:
        # Known once an event is armed. Under the plugin's QEMU (TCG: no paravirtual sched_clock, an HPET) on
        # a kernel with the options above, the guest's clock is the TSC's and qprobe must be able to read it.
        assert target.clock.note is None, target.clock.note
        target.run(f"for i in 1 2 3 4 5 6; do echo {mark} > {TRACING}/trace_marker; done").check()
    finally:
        target.remove_event(ev)
        target.set_kprobes_optimization(True)
    trace = target.run(f"cat {TRACING}/trace").check().output
    guest = [float(m.group(1)) for m in re.finditer(rf" (\d+\.\d+): tracing_mark_write: {mark}", trace)]
    ours = [h.ts for h in ev.hits]
    assert len(ours) == len(guest) == 6, trace
    # The guest prints microseconds and stamps a few hundred instructions after qprobe's probe.  A
    # detour carries its own TSC; a VM stop's time is the HPET's when QEMU has stopped, some time after
    # the trap.  The guest's "global" clock (its default under TCG) is the TSC's time clamped to its
    # CPU's ticks: it never runs more than a tick past that CPU's last one nor backward
    # (sched_clock_local), nor behind the last stamp any CPU took (trace_clock_global).  So one stamp
    # can be up to a tick off the TSC's time either way (seen: the first marker after an idle spell
    # printed 3.6 ms late), while most are within microseconds of it.  A tick that comes late (a busy
    # host delays TCG's timers) holds the clock at its ceiling, the last tick's time plus one tick
    # (sched_clock_local's max_clock): the guest then prints one stamp again and again, earlier than
    # the TSC's time, for markers tens of microseconds apart.  Those held stamps are the clamp's,
    # not a conversion's, and are left out of "most".
    assert target.image is not None
    tick = 1 / int(target.image.config_option("HZ") or 0)
    near = 0.001 if optimized else 0.005
    pairs = list(zip(ours, guest, strict=True))
    assert max(abs(g - q) for q, g in pairs) < tick + near, (ours, guest)
    held = [i for i in range(1, len(guest)) if guest[i] == guest[i - 1] and guest[i] < ours[i]]
    free = [abs(g - q) for i, (q, g) in enumerate(pairs) if i not in held]
    assert sorted(free)[len(free) // 2] < near, (ours, guest, held)
