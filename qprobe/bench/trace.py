"""Trace lines to a pipe, and tearing down a glob's hundreds of events.

The teardown is timed twice: ``Target.remove_events`` in this VM, and one
Ctrl-C to a ``qprobe trace`` of the glob in its own.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import TextIO

import qprobe
from qprobe.bench.common import TRACEFS, _wait_for_optimizer
from qprobe.cli.trace import LINES_GC_THRESHOLD
from qprobe.errors import TargetError
from qprobe.events import EventHit

TRACE_READS = 20_000  # reads of one byte: a hot loop whose every hit is a trace line


def _trace_lines(target: qprobe.Target) -> list[tuple[str, str]]:
    """Trace lines through the record rings to a pipe, as ``qprobe trace ... | consumer`` has them, and the
    guest's own kprobe_events writing the same hits into its ftrace ring."""
    cmd = f"workload read {TRACE_READS} 1"
    read_end, write_end = os.pipe()
    lines = [0]

    def consume() -> None:
        with os.fdopen(read_end, "rb") as pipe:
            for _ in pipe:
                lines[0] += 1

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    # Written as qprobe trace writes: in blocks, flushed after each run of hits the timeline hands on,
    # with its collector thresholds.
    out = os.fdopen(write_end, "w")
    target.timeline.flushers.append(out.flush)
    gc_before = gc.get_threshold()
    gc.set_threshold(*LINES_GC_THRESHOLD)
    try:
        rows = _trace_line_rows(target, cmd, out, lines)
    finally:
        gc.set_threshold(*gc_before)
        target.timeline.flushers.remove(out.flush)
    out.close()
    reader.join(10)
    return rows


def _trace_line_rows(target: qprobe.Target, cmd: str, out: TextIO, lines: list[int]) -> list[tuple[str, str]]:
    """_trace_lines' rows: the command traced with the rings waiting, then lossy; the guest's own."""
    rows: list[tuple[str, str]] = []
    for lossy in (False, True):
        target.records_lossy = lossy
        waits_before, start_lines = target.record_waits(), lines[0]
        by_pid: dict[int, int] = {}

        def show(hit: EventHit, by_pid: dict[int, int] = by_pid) -> None:  # in the guest's order, as trace prints
            by_pid[hit.pid] = by_pid.get(hit.pid, 0) + 1
            target.timeline.push(hit.order, lambda: print(hit.line(), file=out))

        te = target.add_event("p:qpbench/rd ksys_read fd=%di:s32 count=%dx:u64", show)
        try:
            t = time.perf_counter()
            said = target.run(cmd, timeout=1800).check().output
            target.timeline.flush()
            seconds = time.perf_counter() - t
            m = re.search(r"\bpid=(\d+)", said)
            mine = by_pid.get(int(m.group(1)), 0) if m else 0
        finally:
            target.remove_event(te)
        delivered = lines[0] - start_lines
        waits = target.record_waits() - waits_before
        mode = "lossy (--lossy: drop on a full ring)" if lossy else "default (a full ring makes the vCPU wait)"
        rows.append((f"trace lines to a pipe, {mode}: `{cmd}`",
                     f"{delivered} lines ({mine} of the command's {TRACE_READS} reads, {te.lost} lost, "
                     f"{waits} waits) in {seconds:.2f} s: {delivered / seconds:,.0f} lines/s"))  # fmt: skip
    target.records_lossy = False
    ring = target.arch.guest_ram
    assert ring is not None  # the records came through the rings
    kb = target.records_buffer_size_kb
    rows.append(("largest burst held without waiting (record ring, per vCPU)",
                 f"{kb * 1024 // ring.ring_entry_size} records ({kb} KiB)"))  # fmt: skip
    # The guest's own: the same definition in its kprobe_events, its ftrace ring (buffer_size_kb per CPU).
    target.run(f"mountpoint -q {TRACEFS} || mount -t tracefs nodev {TRACEFS}; echo > {TRACEFS}/trace; "
               f"echo 'p:qpbench ksys_read fd=%di:s32 count=%dx:u64' > {TRACEFS}/kprobe_events && "
               f"echo 1 > {TRACEFS}/events/kprobes/qpbench/enable").check()  # fmt: skip
    try:
        t = time.perf_counter()
        target.run(cmd, timeout=1800).check()
        seconds = time.perf_counter() - t
        ftrace = target.run(f"echo 0 > {TRACEFS}/events/kprobes/qpbench/enable; grep -c qpbench: {TRACEFS}/trace; "
                            f"cat {TRACEFS}/buffer_size_kb").check().output.split()  # fmt: skip
    finally:
        target.run(f"echo 0 > {TRACEFS}/events/kprobes/qpbench/enable; "
                   f"echo '-:qpbench' >> {TRACEFS}/kprobe_events").check()  # fmt: skip
    rows.append((f"the guest's own kprobe_events, same definition: `{cmd}`",
                 f"{int(ftrace[0])} lines in its ftrace ring ({ftrace[1]} KiB per CPU) in {seconds:.2f} s: "
                 f"{int(ftrace[0]) / seconds:,.0f} lines/s"))  # fmt: skip
    return rows


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
