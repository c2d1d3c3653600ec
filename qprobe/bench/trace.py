"""Trace lines to a pipe (beside the guest's own kprobe_events), and tearing down a glob's hundreds of events.

The teardown is timed twice: ``Target.remove_events`` in this VM, and one
Ctrl-C to a ``qprobe trace`` of the glob in its own.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import re
import signal
import subprocess
import sys
import threading
import time

import qprobe
from qprobe.bench.common import _wait_for_optimizer
from qprobe.bench.ring import RING_DEFINITION, _guest_own
from qprobe.cli.output import _Trace
from qprobe.cli.trace import LINES_GC_THRESHOLD
from qprobe.errors import TargetError
from qprobe.events import EventHit
from qprobe.events.lines import InOrderLines, LineRun

LINE_CALLS = 200_000  # lseek calls in a tight loop: every one a trace line


def _trace_lines(target: qprobe.Target) -> tuple[list[tuple[str, str]], list[str]]:
    """Trace lines through the record rings to a pipe, as ``qprobe trace --run CMD ... | consumer`` writes them
    (its printer, in blocks), and the guest's own kprobe_events on the same definition; the target: 100,000
    lines a second, none lost."""
    read_end, write_end = os.pipe()
    lines = [0]

    def consume() -> None:
        with os.fdopen(read_end, "rb") as pipe:
            for _ in pipe:
                lines[0] += 1

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    trace = _Trace(argparse.Namespace(format=None, json=False, map=None, filter=None, run=None, boot=False,
                                      kernel_image=None, kernel_cmdline=None, attach=None))  # fmt: skip
    trace.tty, trace.out = False, os.fdopen(write_end, "w")
    target.timeline.flushers.append(trace.flush)
    gc_before = gc.get_threshold()
    gc.set_threshold(*LINES_GC_THRESHOLD)
    try:
        rows, rate, lost = _trace_line_rows(target, trace, lines)
    finally:
        gc.set_threshold(*gc_before)
        target.timeline.flushers.remove(trace.flush)
    trace.out.close()
    reader.join(10)
    own, own_rate = _guest_own(target, LINE_CALLS)
    met = "met" if rate >= 100_000 and not lost else "NOT met"
    return [*rows, own], [f"- {met}: `trace` of a hot loop to a pipe writes ≥ 100,000 lines/s, none lost "
                          f"({rate:,.0f} lines/s, {lost} lost; the guest's own kprobe_events {own_rate:,.0f} "
                          "hits/s)"]  # fmt: skip


def _trace_line_rows(target: qprobe.Target, trace: _Trace, lines: list[int]
                     ) -> tuple[list[tuple[str, str]], float, int]:  # fmt: skip
    """_trace_lines' rows, the command traced with the rings waiting, then lossy; the first's lines/s and lost."""
    cmd = f"workload lseek {LINE_CALLS}"
    rows: list[tuple[str, str]] = []
    rate, lost = 0.0, 0
    for lossy in (False, True):
        target.records_lossy = lossy
        by_pid: collections.Counter[int] = collections.Counter()

        def show(hit: EventHit, by_pid: collections.Counter[int] = by_pid) -> None:  # a hit of another path
            by_pid[hit.pid] += 1
            trace.show(hit)

        def show_run(run: LineRun, start: int, stop: int, by_pid: collections.Counter[int] = by_pid) -> None:
            by_pid.update(run.pid[start:stop])
            trace.show_run(run, start, stop)

        te = target.add_event(RING_DEFINITION.replace("qpring/", "qpbench/"), InOrderLines(show, show_run))
        try:
            _wait_for_optimizer(target)
            target.timeline.flush()
            waits_before, start_lines = target.record_waits(), lines[0]
            t = time.perf_counter()
            said = target.run(cmd, timeout=1800).check().output
            target.timeline.flush()
            trace.flush()
            seconds = time.perf_counter() - t
            m = re.search(r"\bpid=(\d+)", said)
            mine = by_pid.get(int(m.group(1)), 0) if m else 0
            waits = target.record_waits() - waits_before
        finally:
            target.remove_event(te)
        deadline = time.monotonic() + 10
        while lines[0] - start_lines < sum(by_pid.values()) and time.monotonic() < deadline:
            time.sleep(0.01)  # the reader's count catching up with the pipe
        delivered = lines[0] - start_lines
        mode = "lossy (--lossy: drop on a full ring)" if lossy else "default (a full ring makes the vCPU wait)"
        rows.append((f"trace lines to a pipe, {mode}: `{cmd}`",
                     f"{delivered} lines ({mine} of the command's {LINE_CALLS} calls, {te.lost} lost, "
                     f"{waits} waits) in {seconds:.2f} s: {delivered / seconds:,.0f} lines/s"))  # fmt: skip
        if not lossy:
            rate, lost = delivered / seconds, te.lost
    target.records_lossy = False
    ring = target.arch.guest_ram
    assert ring is not None  # the records came through the rings
    kb = target.records_buffer_size_kb
    rows.append(("largest burst held without waiting (record ring, per vCPU)",
                 f"{kb * 1024 // ring.ring_entry_size} records ({kb} KiB)"))  # fmt: skip
    return rows, rate, lost


# Several hundred events from one glob: the syscall entry points (451 on debian-cloud's 6.1).
WILDCARD = "__x64_sys_*"


def _wildcard_teardown(target: qprobe.Target) -> tuple[int, float, float]:
    """(N, arming s, removal s) of one glob's N events, removed once the optimizer has placed their jumps
    (as in a ``qprobe trace`` left running before its Ctrl-C)."""
    t = time.perf_counter()
    wild = target.add_events(f"p:qpwild {WILDCARD}")
    arm = time.perf_counter() - t
    _wait_for_optimizer(target)
    t = time.perf_counter()
    target.remove_events(wild.events)
    return len(wild.events), arm, time.perf_counter() - t


def _trace_ctrl_c(args: argparse.Namespace) -> tuple[int, float, int, int]:
    """``qprobe trace 'p:sys WILDCARD'`` in its own VM, one SIGINT once it is tracing: (N, seconds from the SIGINT to
    its exit, its exit status, its summary's rows)."""
    definition = f"p:sys {WILDCARD}"
    argv = [sys.executable, "-m", "qprobe.cli", "trace", "--image", args.image, "--smp", str(args.smp),
            "--memory", args.memory, definition]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    try:
        said = ""
        while "Ctrl-C to stop" not in said:
            said = proc.stderr.readline()
            if not said and proc.poll() is not None:
                raise TargetError(f"`qprobe trace {definition!r}` ended before it traced: {proc.stderr.read()[-300:]}")
        n = int(re.search(r"tracing (\d+) event", said).group(1))  # type: ignore[union-attr]
        time.sleep(2)  # running, as a trace is when someone presses Ctrl-C
        t = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=600)
        seconds = time.perf_counter() - t
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return n, seconds, proc.returncode, sum(line.startswith("# ") for line in out.splitlines())


def _teardown_rows(wild: tuple[int, float, float] | None, ctrl_c: tuple[int, float, int, int] | None
                   ) -> tuple[list[tuple[str, str]], list[str]]:  # fmt: skip
    """The wildcard's rows and their targets: removal within 2x the arming, Ctrl-C's exit within 3 s."""
    rows: list[tuple[str, str]] = []
    targets: list[str] = []
    if wild is not None:
        n, arm, remove = wild
        rows += [(f"arming {n} events of one glob (`p:qpwild {WILDCARD}`, `Target.add_events`)", f"{arm:.2f} s"),
                 (f"removing those {n} events (`Target.remove_events`)", f"{remove:.2f} s")]  # fmt: skip
        targets.append(f"- {'met' if remove <= 2 * arm else 'NOT met'}: removing {n} events takes ≤ 2x arming "
                       f"them ({remove:.2f} s vs {arm:.2f} s)")  # fmt: skip
    if ctrl_c is not None:
        n, seconds, status, summary = ctrl_c
        rows.append((f"`qprobe trace 'p:sys {WILDCARD}'` ({n} events): one SIGINT to its exit",
                     f"{seconds:.2f} s (exit {status}, {summary} summary rows)"))  # fmt: skip
        targets.append(f"- {'met' if seconds <= 3 else 'NOT met'}: Ctrl-C ends `qprobe trace` with {n} events "
                       f"armed within 3 s ({seconds:.2f} s)")  # fmt: skip
    return rows, targets
