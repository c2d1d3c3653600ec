"""The probe-cost matrix: each kind of kprobe, kretprobe and uprobe on the workloads.

Beside them, the guest's own kprobe_events and uprobe_events on the same code.
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import qprobe
from qprobe.bench.common import FAST_RUNS, TRACEFS, WORKLOADS, Row, _guest_seconds, _paired, workload_function
from qprobe.events import TraceEvent


def _probe_matrix(target: qprobe.Target, args: argparse.Namespace) -> list[tuple[str, Row]]:
    rows: list[tuple[str, Row]] = []
    optimizer = target.kprobes.optimizer
    can_optimize = optimizer is not None and optimizer.available
    for name, funcs, cmd, fast, slow in WORKLOADS:
        func = workload_function(lambda f: f in target.symbols, funcs)
        n_fast, n_slow = fast * args.hits // 2000, max(slow * args.hits // 2000, 5)
        base = statistics.median(_guest_seconds(target, cmd.format(n=n_fast)) for _ in range(3)) / n_fast
        rows.append(("", Row(name, "unprobed", "", n_fast, 0, base * n_fast, base)))
        rows.append(("", _guest_kprobe_events(target, name, func, cmd, n_fast)))
        variants = (
            ("k", "kprobe: int3, copy run to a second int3, Python handler", False, False, "k"),
            ("b", "kprobe: int3, boosted, Python handler", True, False, "k"),
            ("a", "kprobe anywhere: gdbstub breakpoint, stepped in place, Python handler", False, False, "a"),
            ("o", "kprobe: jump-optimized, Python handler through the mailbox, no VM stop", True, True, "k"),
            ("f", "kprobe: jump-optimized, in-guest count, nobody woken", True, True, "f"),
            ("r", "kretprobe: int3, copy run to a second int3, Python handler", False, False, "r"),
            ("rb", "kretprobe: int3, boosted, Python handler", True, False, "r"),
            ("ro", "kretprobe: jump-optimized, guest instance, Python handler at the return", True, True, "r"),
            ("rf", "kretprobe: jump-optimized, instance and return count in the guest, nobody woken", True, True, "rf"),
        )
        for key, what, boost, optimize, kind in variants:
            if optimize and not can_optimize:
                continue
            target.kprobes.dispatcher.boost = boost
            if can_optimize:
                target.set_kprobes_optimization(optimize)
            n = n_fast if optimize else n_slow
            probe: qprobe.Kprobe | qprobe.Kretprobe
            if kind in ("r", "rf"):
                handler = (lambda ri, regs: regs.return_value()) if kind == "r" else None
                probe = qprobe.Kretprobe(symbol_name=func, handler=handler)
                target.register_kretprobe(probe)
            else:
                pre = (lambda kp, regs: regs.arg(1)) if kind != "f" else None
                probe = qprobe.Kprobe(symbol_name=func, pre_handler=pre, anywhere=kind == "a")
                target.register_kprobe(probe)
            runs = FAST_RUNS  # the median of a few paired runs: every row is short and noisy
            try:
                if isinstance(probe, qprobe.Kretprobe):
                    on, off = partial(target.enable_kretprobe, probe), partial(target.disable_kretprobe, probe)
                else:
                    on, off = partial(target.enable_kprobe, probe), partial(target.disable_kprobe, probe)
                seconds, row_base = _paired(target, cmd.format(n=n), on, off)
                row_base /= n
            finally:
                if isinstance(probe, qprobe.Kretprobe):
                    target.unregister_kretprobe(probe)
                else:
                    target.unregister_kprobe(probe)
            returns = f", {probe.nreturns // runs} returns" if isinstance(probe, qprobe.Kretprobe) else ""
            what = f"{what} ({probe.nmissed} missed{returns})"
            rows.append(("", Row(name, key, what, n, probe.nhit // runs, seconds, row_base)))
    target.kprobes.dispatcher.boost = True
    if can_optimize:
        target.set_kprobes_optimization(True)
    return rows


# User-space probes: a tight loop of calls to the guest's uprog's qpt_target (a 5-byte leaf), each run one
# process (its start-up is in the unprobed time of the pair too).
UPROBE_WORKLOAD = ("tight `uprog call` loop", "/bin/uprog", "qpt_target", "uprog call {n} 1 2 b", 4000, 200)


def _uprobe_rows(target: qprobe.Target, args: argparse.Namespace) -> list[tuple[str, Row]]:
    name, path, func, cmd, fast, slow = UPROBE_WORKLOAD
    n_fast, n_slow = fast * args.hits // 2000, max(slow * args.hits // 2000, 5)
    target.run(f"cat {path} >/dev/null").check()  # in the dentry and page caches: its ELF is read from there
    offset = target.uprobes.elf(path).resolve(func)
    base = statistics.median(_guest_seconds(target, cmd.format(n=n_fast)) for _ in range(3)) / n_fast
    rows: list[tuple[str, Row]] = [("", Row(name, "unprobed", "", n_fast, 0, base * n_fast, base))]
    if target.run(f"test -w {TRACEFS}/uprobe_events").status == 0:
        for kind, what in (("p", "entry"), ("r", "return")):
            rows.append(("", _guest_uprobe_events(target, name, f"{path}:{offset:#x}", kind, what,
                                                  cmd.format(n=n_fast), n_fast)))  # fmt: skip
    kinds: list[tuple[str, str, qprobe.Uprobe, int]] = [
        ("u", "uprobe: gdbstub breakpoint, the instruction performed on the host (else stepped), Python handler",
         qprobe.Uprobe(path, offset, handler=lambda up, regs: regs.arg(1)), n_slow),
        ("ur", "uretprobe: breakpoints at the entry and the return address, Python handler",
         qprobe.Uretprobe(path, offset, ret_handler=lambda up, func, regs: regs.return_value()), n_slow),
    ]  # fmt: skip
    why = target.uprobes.guest.unavailable if target.uprobes.guest is not None else "no guest calls"
    if why is None:
        kinds[:0] = [
            ("uc", "uprobe counted in the guest: the guest kernel's uprobe, qprobe's consumer, no VM stop",
             qprobe.Uprobe(path, offset, in_guest=True), n_fast),
            ("urc", "uretprobe counted in the guest: the guest kernel's uretprobe, qprobe's consumer, no VM stop",
             qprobe.Uretprobe(path, offset, in_guest=True), n_fast),
        ]  # fmt: skip
    for key, what, probe, n in kinds:
        registered = False

        def on(probe: qprobe.Uprobe = probe) -> None:
            nonlocal registered
            if not registered:
                target.register_uprobe(probe)
                registered = True

        def off(probe: qprobe.Uprobe = probe) -> None:
            nonlocal registered
            if registered:
                target.unregister_uprobe(probe)
                registered = False

        try:
            seconds, row_base = _paired(target, cmd.format(n=n), on, off)
        finally:
            off()
        returns = f", {probe.nreturns // FAST_RUNS} returns" if isinstance(probe, qprobe.Uretprobe) else ""
        hits = probe.nreturns if isinstance(probe, qprobe.Uretprobe) else probe.nhit
        rows.append(("", Row(name, key, f"{what} ({probe.nmissed} missed{returns})", n,
                             hits // FAST_RUNS, seconds, row_base / n)))  # fmt: skip
    guest = target.uprobes.guest
    if guest is not None and guest.records_unavailable is None:
        where = f"{path}:{offset:#x}"
        for key, definition, what in (
            ("ut", f"p:qpbut {where} a=%di b=%si", "uprobe event recorded in the guest: the guest kernel's uprobe, "
             "qprobe's handler writes the ring, a trace line off it, no VM stop"),
            ("urt", f"r:qpburt {where} ret=$retval", "uretprobe event recorded in the guest, as ut"),
        ):  # fmt: skip
            rows.append(("", _recorded_event_row(target, name, key, definition, what, cmd.format(n=n_fast), n_fast)))
    return rows


def _recorded_event_row(target: qprobe.Target, name: str, key: str, definition: str, what: str, cmd: str,
                        n: int) -> Row:  # fmt: skip
    """A uprobe event whose hits the guest records (its lines made off the ring), added for each probed run."""
    events: list[TraceEvent] = []
    armed = False

    def on() -> None:
        nonlocal armed
        if not armed:
            events.append(target.add_event(definition))
            armed = True

    def off() -> None:
        nonlocal armed
        if armed:
            target.remove_event(events[-1])
            armed = False

    try:
        seconds, row_base = _paired(target, cmd, on, off)
    finally:
        off()
    lost = sum(te.lost for te in events)
    return Row(name, key, f"{what} ({lost} lost)", n, sum(te.nhit for te in events) // FAST_RUNS, seconds,
               row_base / n)  # fmt: skip


def _guest_uprobe_events(target: qprobe.Target, name: str, where: str, kind: str, what: str, cmd: str,
                         n: int) -> Row:  # fmt: skip
    """The guest kernel's own uprobe_events on the same instruction: its int3 and out-of-line step."""
    enable = f"{TRACEFS}/events/uprobes/qpubench/enable"
    target.run(f"mountpoint -q {TRACEFS} || mount -t tracefs nodev {TRACEFS}; "
               f"echo '{kind}:qpubench {where}' > {TRACEFS}/uprobe_events").check()  # fmt: skip
    try:
        seconds, row_base = _paired(target, cmd, lambda: target.run(f"echo 1 > {enable}").check(),
                                    lambda: target.run(f"echo 0 > {enable}").check())  # fmt: skip
        profile = target.run(f"cat {TRACEFS}/uprobe_profile").check().output
    finally:
        target.run(f"echo 0 > {enable}; echo '-:qpubench' >> {TRACEFS}/uprobe_events").check()
    hits = next(int(line.split()[-1]) for line in profile.splitlines() if "qpubench" in line.split()) // FAST_RUNS
    return Row(name, f"uprobe_events {kind}", f"the guest's own uprobe_events, {what} (in-kernel uprobe, trace event)",
               n, hits, seconds, row_base / n)  # fmt: skip


def _guest_kprobe_events(target: qprobe.Target, name: str, func: str, cmd: str, n: int) -> Row:
    """The guest kernel's own kprobe_events on the same function: the native reference."""
    target.run(f"mountpoint -q {TRACEFS} || mount -t tracefs nodev {TRACEFS}; "
               f"echo 'p:qpbench {func}' > {TRACEFS}/kprobe_events && "
               f"echo 1 > {TRACEFS}/events/kprobes/qpbench/enable").check()  # fmt: skip
    enable = f"{TRACEFS}/events/kprobes/qpbench/enable"
    try:
        seconds, row_base = _paired(target, cmd.format(n=n), lambda: target.run(f"echo 1 > {enable}").check(),
                                    lambda: target.run(f"echo 0 > {enable}").check())  # fmt: skip
        profile = target.run(f"cat {TRACEFS}/kprobe_profile").check().output
    finally:
        target.run(f"echo 0 > {TRACEFS}/events/kprobes/qpbench/enable; "
                   f"echo '-:qpbench' >> {TRACEFS}/kprobe_events").check()  # fmt: skip
    hits = next(int(line.split()[1]) for line in profile.splitlines() if line.split()[:1] == ["qpbench"]) // FAST_RUNS
    return Row(name, "kprobe_events", "the guest's own kprobe_events (in-kernel kprobe, ftrace event)", n, hits,
               seconds, row_base / n)  # fmt: skip
