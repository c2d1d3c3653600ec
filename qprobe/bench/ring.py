"""Ring handlers (``Target.ring_buffer``): hits per second into Python off the record rings, beside the guest's own.

A tight ``workload lseek`` loop, its every ``ksys_lseek`` a hit: unprobed; with a trivial ring handler
(it counts the workload's hits); with one that cannot keep up (a fixed cost a hit), the rings waiting and
then lossy; and with the guest's own kprobe_events on the same definition, its hits from kprobe_profile.
"""

from __future__ import annotations

import re
import threading
import time

import qprobe
from qprobe.bench.common import TRACEFS, _wait_for_optimizer
from qprobe.events import Samples

RING_CALLS = 200_000  # lseek calls: long enough that the run's start-up is a small part of it
SLOW_CALLS = 20_000
SLOW_HANDLER = 20e-6  # seconds a hit the slow handler spends: it keeps up with 50,000 hits a second at most
RING_DEFINITION = "p:qpring/ls ksys_lseek fd=%di:u32 offset=%si:s64 whence=%dx:u32"
_QUIET = 1.0  # seconds without a batch, after the command ended, that say the rings are drained


def _pid_of(said: str) -> int:
    m = re.search(r"\bpid=(\d+)", said)
    return int(m.group(1)) if m else -1


def _ring_run(target: qprobe.Target, calls: int, per_hit: float) -> tuple[tuple[str, str], float, int]:
    """One run of the loop into a ring handler costing ``per_hit`` seconds a hit: its row, hits/s and waits."""
    lock = threading.Lock()
    by_pid: dict[int, int] = {}
    last = [0.0]
    done = threading.Event()

    def sample_cb(samples: Samples) -> None:
        with lock:
            for pid in samples.pid:
                by_pid[pid] = by_pid.get(pid, 0) + 1
            last[0] = time.perf_counter()
        if per_hit:
            time.sleep(per_hit * len(samples))
        done.set()

    te = target.ring_buffer(RING_DEFINITION, sample_cb)
    try:
        _wait_for_optimizer(target)
        waits_before = target.record_waits()
        t = time.perf_counter()
        pid = _pid_of(target.run(f"workload lseek {calls}", timeout=1800).check().output)
        ended = time.perf_counter()
        while by_pid.get(pid, 0) < calls and time.perf_counter() - max(last[0], ended) < _QUIET:
            done.wait(0.05)
            done.clear()
        seconds = max(last[0], t) - t
        waits = target.record_waits() - waits_before
        mine, total, lost = by_pid.get(pid, 0), sum(by_pid.values()), te.lost
        faults = te.probe.nfaults if te.probe is not None else 0
    finally:
        target.remove_event(te)
    what = "trivial (counts hits by pid)" if not per_hit else f"{per_hit * 1e6:.0f} µs a hit"
    mode = "lossy rings" if target.records_lossy else "a full ring makes the vCPU wait"
    rate = total / seconds if seconds else 0.0
    row = (f"ring handler, {what}, {mode}: `workload lseek {calls}`",
           f"{total} hits ({mine} of the command's {calls} calls, {lost} lost, {waits} waits, {faults} handler "
           f"faults) in {seconds:.2f} s: {rate:,.0f} hits/s")  # fmt: skip
    return row, rate, waits


def _guest_own(target: qprobe.Target, calls: int) -> tuple[tuple[str, str], float]:
    """The guest's own kprobe_events on the same definition, its hits counted in kprobe_profile."""
    own = RING_DEFINITION.replace("qpring/ls", "qpbench_ring")
    target.run(f"mountpoint -q {TRACEFS} || mount -t tracefs nodev {TRACEFS}; echo > {TRACEFS}/trace; "
               f"echo '{own}' >> {TRACEFS}/kprobe_events && "
               f"echo 1 > {TRACEFS}/events/kprobes/qpbench_ring/enable").check()  # fmt: skip
    try:
        t = time.perf_counter()
        target.run(f"workload lseek {calls}", timeout=1800).check()
        seconds = time.perf_counter() - t
        profile = target.run(f"echo 0 > {TRACEFS}/events/kprobes/qpbench_ring/enable; "
                             f"grep qpbench_ring {TRACEFS}/kprobe_profile").check().output.split()  # fmt: skip
    finally:
        target.run(f"echo 0 > {TRACEFS}/events/kprobes/qpbench_ring/enable; "
                   f"echo '-:qpbench_ring' >> {TRACEFS}/kprobe_events").check()  # fmt: skip
    hits, rate = int(profile[1]), int(profile[1]) / seconds
    return (f"the guest's own kprobe_events, same definition: `workload lseek {calls}`",
            f"{hits} hits (kprobe_profile) in {seconds:.2f} s: {rate:,.0f} hits/s"), rate  # fmt: skip


def _ring_handler_rows(target: qprobe.Target) -> tuple[list[tuple[str, str]], list[str]]:
    """The loop unprobed, into a trivial ring handler, into a slow one (waiting, then lossy), and the guest's own;
    and the target: a trivial ring handler takes 200,000 hits a second."""
    t = time.perf_counter()
    target.run(f"workload lseek {RING_CALLS}", timeout=1800).check()
    seconds = time.perf_counter() - t
    rows = [(f"unprobed: `workload lseek {RING_CALLS}`", f"{seconds:.2f} s: {RING_CALLS / seconds:,.0f} calls/s")]
    trivial, rate, waits = _ring_run(target, RING_CALLS, 0.0)
    rows += [trivial, _ring_run(target, SLOW_CALLS, SLOW_HANDLER)[0]]
    target.records_lossy = True
    try:
        rows.append(_ring_run(target, SLOW_CALLS, SLOW_HANDLER)[0])
    finally:
        target.records_lossy = False
    own, own_rate = _guest_own(target, RING_CALLS)
    rows.append(own)
    met = "met" if rate >= 200_000 else "NOT met"
    return rows, [f"- {met}: a trivial ring handler takes ≥ 200,000 hits/s ({rate:,.0f} hits/s, {waits} vCPU "
                  f"waits; the guest's own kprobe_events {own_rate:,.0f} hits/s)"]  # fmt: skip


__all__ = ["RING_CALLS", "RING_DEFINITION", "SLOW_CALLS", "_ring_handler_rows"]
