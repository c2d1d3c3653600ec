"""Scale: N probes at once, qprobe's and the guest's own kprobe_events on the same functions."""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass

import qprobe
from qprobe.bench.common import TRACEFS, WORKLOADS, Shell, _guest_seconds, _plain_vm, _wait_for_optimizer
from qprobe.errors import GuestPanicked, GuestTimeout, TargetError, TargetGone

SCALE = (1, 10, 100, 1000)
SCALE_ITERATIONS = 20  # fork-heavy loop iterations per counting row and the guest's
SCALE_PY_ITERATIONS = 2  # per Python-handler row: its probes are on the loop's hottest functions, each call a wake-up


@dataclass
class ScaleRow:
    """N probes at once: what registering, running under and removing them costs."""

    n: int
    what: str
    register_s: float
    unregister_s: float
    slowdown: float
    hits: int
    rss_mb: float | None = None
    scratch_kb: float | None = None
    failed: str | None = None  # why the row has no figures (the guest panicked, say)

    def line(self) -> str:
        if self.failed is not None:
            failed = self.failed.replace("|", "\\|")
            return f"| {self.n} | {self.what}: {failed} | - | - | - | - | - | - |"
        rss = f"{self.rss_mb:.0f}" if self.rss_mb is not None else "-"
        scratch = f"{self.scratch_kb:,.0f}" if self.scratch_kb is not None else "-"
        return (f"| {self.n} | {self.what} | {self.register_s:.2f} | {self.unregister_s:.2f} | "
                f"{self.slowdown:.2f}x | {self.hits:,} | {rss} | {scratch} |")  # fmt: skip


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def reached_functions(target: qprobe.Target, cmd: str) -> list[str]:
    """Functions ``cmd`` reaches, most called first: the guest's function tracer over its traceable functions.

    The tracer covers exactly ``available_filter_functions``; one run of the
    workload with it on, then it is off again before any qprobe probe exists
    (tracing_on goes to 0 first: switching the tracer empties the buffer).
    """
    t = TRACEFS
    # One function name per line (no task, CPU, flags or parent): the guest formats and sorts less.
    out = target.run(
        f"[ -e {t}/trace ] || mount -t tracefs nodev {t}; size=$(cat {t}/buffer_size_kb); "
        f"echo 8192 > {t}/buffer_size_kb; echo nocontext-info > {t}/trace_options; "
        f"echo noprint-parent > {t}/trace_options; echo function > {t}/current_tracer; {cmd}; "
        f"echo 0 > {t}/tracing_on; grep -v '^#' {t}/trace | sort | uniq -c | sort -rn; "
        f"echo nop > {t}/current_tracer; echo context-info > {t}/trace_options; "
        f"echo print-parent > {t}/trace_options; echo 1 > {t}/tracing_on; echo ${{size%% *}} > {t}/buffer_size_kb",
        timeout=300,
    ).check().output  # fmt: skip
    return [line.split()[1] for line in out.splitlines() if len(line.split()) == 2 and line.split()[0].isdigit()]


def probeable_entries(target: qprobe.Target, names: list[str]) -> list[str]:
    """The names whose entry qprobe would arm: the kernel's checks on the name, then on the address armed.

    A probe on a function's ``__fentry__`` site is armed on the next instruction,
    which can be a site the kernel rewrites (a jump label) although the entry is not.
    """
    from qprobe.events.funcs import Probeability

    prob, sites = Probeability.of_target(target), target.kprobes.sites
    out = []
    for name in names:
        if prob.reason(name) is not None:
            continue
        try:
            at = sites.kprobe_addr(qprobe.Kprobe(symbol_name=name))
            sites.check_kprobe_address_safe(at + sites.ftrace_site(at))
        except qprobe.QprobeError:
            continue
        out.append(name)
    return out


def _optimizable(target: qprobe.Target, names: list[str], want: int) -> list[str]:
    """Up to ``want`` of ``names`` that the guest's kprobe_events accepts and qprobe jump-optimizes.

    Found by defining each as a guest kprobe event once (then removing it) and
    registering the accepted ones with qprobe once, in one batch.
    """
    candidates = probeable_entries(target, names)
    refused = set(_guest_refuses(target, candidates))
    kps = [qprobe.Kprobe(symbol_name=name) for name in candidates if name not in refused]
    target.register_kprobes(kps)
    _wait_for_optimizer(target)
    points = target.kprobes.points
    good = [kp.symbol_name for kp in kps if points[kp.resolved].opt is not None]
    target.unregister_kprobes(kps)
    return [name for name in good if name is not None][:want]


def _write_guest_defs(target: Shell, names: list[str]) -> None:
    """/tmp/qpdefs in the guest: one ``p:qpscale/pN NAME`` line per name (sent in pieces a console line holds)."""
    target.run("rm -f /tmp/qpdefs").check()
    for i in range(0, len(names), 50):
        lines = "\\n".join(f"p:qpscale/p{j} {name}" for j, name in enumerate(names[i : i + 50], i))
        target.run(f"printf '{lines}\\n' >> /tmp/qpdefs").check()


def _guest_refuses(target: qprobe.Target, names: list[str]) -> list[str]:
    """The names the guest's kprobe_events refuses (each tried alone, then every accepted one removed)."""
    t = TRACEFS
    _write_guest_defs(target, names)
    out = target.run(
        f"while read d; do echo \"$d\" >> {t}/kprobe_events 2>/dev/null || echo \"REFUSED ${{d#* }}\"; done "
        f"< /tmp/qpdefs; sed 's/^p:\\([^ ]*\\) .*/-:\\1/' /tmp/qpdefs | "
        f"while read d; do echo \"$d\" >> {t}/kprobe_events 2>/dev/null; done; true",
        timeout=600,
    ).check().output  # fmt: skip
    return [line.split()[1] for line in out.splitlines() if line.startswith("REFUSED ")]


def _scale(target: qprobe.Target, args: argparse.Namespace) -> tuple[list[ScaleRow], list[str]]:
    """qprobe's scale rows (N counting probes, N with a Python handler), and the functions they used."""
    _name, _func, cmd, _fast, _slow = WORKLOADS[0]
    names = _optimizable(target, reached_functions(target, cmd.format(n=1)), max(SCALE))
    rows: list[ScaleRow] = []
    scratch = target.kprobes.scratch
    for n in SCALE:
        if n > len(names):
            break
        for what, handler, iterations in (("qprobe, in-guest count", None, SCALE_ITERATIONS),
                                          ("qprobe, Python pre_handler", _noop, SCALE_PY_ITERATIONS)):  # fmt: skip
            loop = cmd.format(n=iterations)
            base = _guest_seconds(target, loop)
            kps = [qprobe.Kprobe(symbol_name=name, pre_handler=handler) for name in names[:n]]
            used = scratch.used
            t = time.perf_counter()
            target.register_kprobes(kps)
            register = time.perf_counter() - t
            waited = _wait_for_optimizer(target)
            scratch_kb = (scratch.used - used) / 1024
            optimized = sum(target.kprobes.points[kp.resolved].opt is not None for kp in kps)
            seconds = _guest_seconds(target, loop)
            rss = _rss_mb()
            t = time.perf_counter()
            target.unregister_kprobes(kps)
            unregister = time.perf_counter() - t
            label = f"{what} ({optimized} optimized, the last {waited:.1f} s after register)"
            rows.append(ScaleRow(n, label, register, unregister, seconds / base, sum(kp.nhit for kp in kps), rss,
                                 scratch_kb))  # fmt: skip
    return rows, names


# The reference VM's TCG runs both vCPUs on one host thread.  With QEMU 7.2's default (one thread per
# vCPU), a guest with nothing attached to its gdbstub panicked ("BUG: kernel NULL pointer dereference",
# RIP 0, from do_idle) or wedged while its ftrace patched thousands of call sites with text_poke_bp;
# with one thread it did not (docs/reliability.md).  Its slowdown is against its own unprobed runs.
REFERENCE_TCG_THREAD = "single"


def _guest_scale_rows(args: argparse.Namespace, names: list[str], accel: str) -> list[ScaleRow]:
    """The guest's own kprobe_events with qprobe's functions, per N, in a second VM without qprobe."""
    thread = REFERENCE_TCG_THREAD if accel == "tcg" else ""
    what = (f"the guest's kprobe_events (second VM, no qprobe, -accel {accel}{f',thread={thread}' if thread else ''}; "
            "definitions, then the group enabled)")  # fmt: skip
    loop = WORKLOADS[0][2].format(n=SCALE_ITERATIONS)
    rows: list[ScaleRow] = []
    with _plain_vm(args, thread) as (_qemu, console):
        console.run(f"[ -e {TRACEFS}/trace ] || mount -t tracefs nodev {TRACEFS}").check()
        for n in SCALE:
            if n > len(names):
                break
            try:
                rows.append(_guest_scale(console, names[:n], loop, what))
            except (GuestPanicked, TargetGone):
                oopses = console.console.oopses() if console.console else []
                lines = [re.sub(r"^\[[ \d.]+\] ", "", line.strip()) for line in oopses]
                said = [line for line in lines if line.startswith(("BUG:", "Kernel panic"))][:2]
                rows.append(ScaleRow(n, what, 0, 0, 0, 0, failed=f"guest panicked ({'; '.join(said) or 'no oops'})"))
                break
            except GuestTimeout:
                rows.append(ScaleRow(n, what, 0, 0, 0, 0, failed="the guest shell stopped answering"))
                break
            except TargetError as exc:  # a tracefs write the guest refused: its own words, and the kernel's
                dmesg = console.run("dmesg | tail -n 3", timeout=60).output.replace("\n", " / ")
                rows.append(ScaleRow(n, what, 0, 0, 0, 0, failed=f"{exc}; dmesg: {dmesg}"[-600:]))
                break
    return rows


def _noop(kp: qprobe.Kprobe, regs: qprobe.PtRegs) -> None:
    return None


def _guest_scale(target: Shell, names: list[str], loop: str, what: str) -> ScaleRow:
    """The guest's own kprobe_events with the same functions: definitions written, then the group enabled."""
    t = TRACEFS
    _write_guest_defs(target, names)
    base = _guest_seconds(target, loop)
    start = time.perf_counter()
    target.run(f"cat /tmp/qpdefs >> {t}/kprobe_events && echo 1 > {t}/events/qpscale/enable", timeout=600).check()
    register = time.perf_counter() - start
    seconds = _guest_seconds(target, loop)
    profile = target.run(f"cat {t}/kprobe_profile").check().output
    hits = sum(int(line.split()[1]) for line in profile.splitlines()
               if line.split()[:1] and re.fullmatch(r"p\d+", line.split()[0]))  # fmt: skip
    # The removals are written by cat from a file, as the definitions are: sed writing them to
    # kprobe_events as its buffer filled failed at N = 1,000 ("sed: write error"; 6.1's
    # trace_parse_run_command runs a line cut by the end of one write as it stands).
    target.run("sed 's/^p:\\([^ ]*\\) .*/-:\\1/' /tmp/qpdefs > /tmp/qpundefs", timeout=60).check()
    start = time.perf_counter()
    target.run(f"echo 0 > {t}/events/qpscale/enable && cat /tmp/qpundefs >> {t}/kprobe_events", timeout=600).check()
    unregister = time.perf_counter() - start
    return ScaleRow(len(names), what, register, unregister, seconds / base, hits)


def _scale_targets(rows: list[ScaleRow]) -> list[str]:
    out = []
    count = next((r for r in rows if r.n == 1000 and r.what.startswith("qprobe, in-guest")), None)
    guest = next((r for r in rows if r.n == 1000 and r.what.startswith("the guest") and r.failed is None), None)

    def check(label: str, ok: bool | None, detail: str) -> None:
        out.append(f"- {'met' if ok else 'NOT met' if ok is not None else 'not measured'}: {label} ({detail})")

    check(
        "registering 1,000 counting probes takes ≤ 2 s and no longer than the guest's kprobe_events arming them",
        count.register_s <= 2 and count.register_s <= guest.register_s if count and guest else None,
        f"{count.register_s:.2f} s vs the guest's {guest.register_s:.2f} s" if count and guest else "-",
    )
    check(
        "the guest with 1,000 counting probes is no slower than with the guest's 1,000 kprobe events",
        count.slowdown <= guest.slowdown if count and guest else None,
        f"{count.slowdown:.2f}x vs {guest.slowdown:.2f}x" if count and guest else "-",
    )
    return out
