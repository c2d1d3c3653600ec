"""``qprobe trace``: definitions checked before boot, armed, their hits shown while the trace runs."""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import threading
from typing import TYPE_CHECKING

from qprobe.errors import TargetGone

from .boot import _boot, _say_booting
from .definitions import _arm, _check_symbols, _parse_definitions, _perf_definitions, _user_forms
from .host import _need_dwarf
from .output import _summarize, _Trace

if TYPE_CHECKING:
    from qprobe.api import Target
    from qprobe.events import TraceEvent
    from qprobe.fetch import Definition, ProbeEvent


# A hit is a few small objects that live until the timeline hands it on (a tenth of a second): at tens of
# thousands of hits a second, collecting the youngest generation every 700 allocations took a third of the
# host's time a line (the ring-fed harness of docs/performance.md).  Collections come less often, not never.
LINES_GC_THRESHOLD = (20_000, 10, 10)


def cmd_trace(args: argparse.Namespace) -> int:
    """Arm kprobe_events definitions, print one line per hit, then a summary.

    With ``--run CMD`` only the hits of CMD's processes are printed (bpftrace's ``-c``),
    ``$cpid`` in the filter is CMD's pid, and CMD's exit status is qprobe's.
    """
    _perf_definitions(args)
    if args.run:  # the command's hits are told by their task's pid, read at the offset the kernel's types give
        _need_dwarf(args, "--run (which keeps the hits of the command's processes)")
    trace = _Trace(args)
    definitions = _check_definitions(args, trace)
    gc.set_threshold(*LINES_GC_THRESHOLD)
    _say_booting(args)
    at_boot: list[TraceEvent] = []

    def arm_at_boot(target: Target) -> None:  # before the kernel's first instruction: stub breakpoints
        _size_rings(target, args)  # the rings are laid out for the first probe optimized once booted
        at_boot.extend(_arm_traced(target, definitions, trace))  # the int3 path once booted, unless --anywhere

    with _boot(args, arm_at_boot if args.boot else None) as target:
        if args.lossy:
            target.records_lossy = True
        _size_rings(target, args)
        events = at_boot if args.boot else _arm_traced(target, definitions, trace)
        status = 0
        try:
            status = _collect(target, events, trace)
        finally:
            _summarize(target, events, trace)
    return status


def _size_rings(target: Target, args: argparse.Namespace) -> None:
    """--buffer-size-kb, before the first recorded probe lays the rings out."""
    if args.buffer_size_kb is not None:
        target.records_buffer_size_kb = args.buffer_size_kb


def _check_definitions(args: argparse.Namespace, trace: _Trace) -> list[str | Definition | ProbeEvent]:
    """Each definition parsed once, before booting where the kernel's vmlinux is at hand: syntax errors
    (events, filter, --format, --map's names) and unknown functions come before a VM does.

    Returns what goes down to the target: each definition's ProbeEvent, its Definition where there is
    none yet (a uprobe's, whose file is the guest's), or its text where nothing parsed it (a VM to attach
    to whose vmlinux is not given: parsed in the running kernel's language; perf's and bpftrace's uprobes).
    """
    from qprobe.fetch import ProbeEvent

    definitions, checked = _parse_definitions(args)
    for ev in checked:
        trace.check(ev)
    if trace.agg is not None:
        from qprobe.shell.collect import check_map_names

        check_map_names(trace.agg, checked)
        if "$stack" in trace.agg.keys:
            _need_dwarf(args, "--map's $stack (a kernel stack trace)")
    _check_symbols(args, [ev for ev in checked if isinstance(ev, ProbeEvent)])
    return definitions


def _arm_traced(target: Target, definitions: list[str | Definition | ProbeEvent], trace: _Trace,
                anywhere: bool | None = None) -> list[TraceEvent]:  # fmt: skip
    """Every definition's events, their hits printed in the guest's order of hits (or folded into the map);
    ``anywhere`` (else --anywhere) arms them with stub breakpoints."""

    from qprobe.events import InOrder
    from qprobe.events.lines import InOrderLines

    # Whatever path a hit took, the timeline hands it on in the guest's order; a ring's runs as blocks of lines.
    lines = None
    if trace.agg is None:
        lines = InOrderLines(trace.show, trace.show_run) if trace.bulk else InOrder(trace.show)
    if lines is not None and trace.flush not in target.timeline.flushers:
        target.timeline.flushers.append(trace.flush)
    flt = None if trace.cpid_filter else trace.filter
    definitions = _user_forms(target, definitions, trace.args.quiet)
    anywhere = trace.args.anywhere if anywhere is None else anywhere
    return [te for d in definitions for te in _arm(target, d, lines, flt, anywhere)]


def _collect(target: Target, events: list[TraceEvent], trace: _Trace) -> int:
    """Hits while the trace runs (until --run's command ends, --duration, or Ctrl-C); then the probes go.

    Returns the exit status: --run's command's, 130 for a Ctrl-C, else 0.
    """
    agg, printed = trace.agg, threading.Event()  # set when the map's interval printing ends
    collector = None
    if agg is not None:
        from qprobe.shell.collect import Collector

        collector = Collector(events, agg, every=trace.every, owns=trace.owns if trace.args.run else None)
        if trace.every is not None:

            def print_every(seconds: float) -> None:  # bpftrace's interval probe: print(@); clear(@)
                while not printed.wait(seconds):
                    agg.print_and_clear(trace.write)

            threading.Thread(target=print_every, args=(trace.every,), name="qprobe-map", daemon=True).start()
    status = 0
    try:
        with collector if collector is not None else contextlib.nullcontext():
            try:
                status = _run_traced(target, events, trace)
            finally:
                printed.set()  # the interval printing ends before the map's last fold
    except KeyboardInterrupt:
        status = 130
    finally:
        try:
            target.remove_events(events)
        except TargetGone:
            pass  # a VM that is gone holds no probes; the summary still says what was seen, then the error
        if agg is not None:
            agg.print_and_clear(trace.write)
    return status


def _run_traced(target: Target, events: list[TraceEvent], trace: _Trace) -> int:
    """Wait while the events trace: --run's command (its exit status returned), --duration, or until Ctrl-C."""
    args = trace.args
    if args.run:
        from qprobe.proctree import ProcessTree

        def on_root(cpid: int) -> None:  # the filter's $cpid, once the command has forked
            if trace.cpid_filter:
                from qprobe.events import event_filter

                for te in events:
                    te.filter = event_filter(te.definition, args.filter.replace("$cpid", str(cpid)))

        trace.tree = tree = ProcessTree(target, on_root)
        if not args.quiet:
            print(f"qprobe: tracing {len(events)} event(s) while {args.run!r} runs", file=sys.stderr, flush=True)
        try:
            result = target.run(args.run, timeout=args.timeout)
        finally:
            tree.close()
        if result.output:
            from qprobe.fetch import terminal_safe

            out = result.output.removesuffix("\n") + "\n"
            sys.stderr.write(terminal_safe(out) if sys.stderr.isatty() else out)
        return result.status  # the command's own, as bpftrace -c passes it through
    if args.duration:
        target.wait(args.duration)
    else:
        print(f"qprobe: tracing {len(events)} event(s); Ctrl-C to stop", file=sys.stderr, flush=True)
        target.wait()
    return 0
