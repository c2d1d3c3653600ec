"""``qprobe bench``: the numbers docs/performance.md quotes, measured on this machine.

Speed is checked here, with a report, never by timed assertions in tests.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Protocol

import qprobe
from qprobe.errors import GuestPanicked, GuestTimeout, TargetError, TargetGone
from qprobe.events import EventHit
from qprobe.kernel import symbols as symbols_mod
from qprobe.vmm.console import Console, GuestShell, RunResult, open_shell
from qprobe.vmm.qemu import QemuConfig, QemuProcess, parse_memory


class Shell(Protocol):
    """A guest shell: qprobe's target or the shell of a VM without qprobe."""

    def run(self, command: str, timeout: float = 60.0) -> RunResult: ...


def _time(fn: Callable[[], object], repeat: int) -> float:
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t) / repeat


def _guest_seconds(target: Shell, cmd: str) -> float:
    t = time.perf_counter()
    target.run(cmd, timeout=1800).check()
    return time.perf_counter() - t


@dataclass
class Row:
    """One probe-cost measurement: a workload run ``iterations`` times with one kind of probe."""

    workload: str
    key: str  # the report's row names: unprobed, gdb, kprobe_events, k, b, o, f, r, rb, ro
    what: str
    iterations: int
    hits: int
    seconds: float
    base: float  # unprobed seconds per iteration, same VM

    @property
    def rate(self) -> float:
        return self.hits / self.seconds if self.seconds else 0.0

    @property
    def added_us(self) -> float:
        return (self.seconds - self.base * self.iterations) / self.hits * 1e6 if self.hits else 0.0

    @property
    def slowdown(self) -> float:
        return self.seconds / self.iterations / self.base if self.base else 0.0

    def line(self) -> str:
        if self.key == "unprobed":
            return f"| {self.workload} | unprobed | no probe | {self.iterations} | - | - | - | 1.00x |"
        return (f"| {self.workload} | {self.key} | {self.what} | {self.iterations} | {self.hits} | "
                f"{self.rate:,.0f} | {self.added_us:,.1f} | {self.slowdown:.2f}x |")  # fmt: skip


# The two workloads: (name, kernel function, guest command for N iterations, iterations fast / stopping)
WORKLOADS = (
    ("fork-heavy `cat /proc/version` loop", "version_proc_show",
     "i=0; while [ $i -lt {n} ]; do cat /proc/version >/dev/null; i=$((i+1)); done", 400, 40),
    # ksys_lseek, not __x64_sys_getppid: qprobe never writes a function's __fentry__ site (the guest's
    # ftrace owns it), and getppid's next instructions (push; call) cannot take a jump.
    ("tight `workload lseek` loop", "ksys_lseek", "workload lseek {n}", 20000, 400),
)  # fmt: skip
TRACEFS = "/sys/kernel/tracing"
FAST_RUNS = 3


def _paired(target: Shell, cmd: str, on: Callable[[], object], off: Callable[[], object]) -> tuple[float, float]:
    """Medians of (probed, unprobed) seconds of ``cmd``, each probed run right after an unprobed one.

    The fast rows add a few percent at most, and a stop-based row's short
    fork-heavy run little more, both less than the guest's speed drifts over a
    minute; pairing every probed run with an unprobed one just before it (the
    probe disabled: its text is the original) measures the difference, not the drift.
    """
    probed, unprobed = [], []
    for _ in range(FAST_RUNS):
        off()
        unprobed.append(_guest_seconds(target, cmd))
        on()
        probed.append(_guest_seconds(target, cmd))
    return statistics.median(probed), statistics.median(unprobed)


def _probe_matrix(target: qprobe.Target, args: argparse.Namespace) -> list[tuple[str, Row]]:
    rows: list[tuple[str, Row]] = []
    optimizer = target.kprobes.optimizer
    can_optimize = optimizer is not None and optimizer.available
    for name, func, cmd, fast, slow in WORKLOADS:
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
            target.kprobes.boost = boost
            if can_optimize:
                target.set_kprobes_optimization(optimize)
            n = n_fast if optimize else n_slow
            probe: qprobe.Kprobe | qprobe.Kretprobe
            if kind in ("r", "rf"):
                handler = (lambda ri, regs: regs.ax) if kind == "r" else None
                probe = qprobe.Kretprobe(symbol_name=func, handler=handler)
                target.register_kretprobe(probe)
            else:
                probe = qprobe.Kprobe(symbol_name=func, pre_handler=(lambda kp, regs: regs.di) if kind != "f" else None,
                                      anywhere=kind == "a")  # fmt: skip
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
    target.kprobes.boost = True
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
    for key, what, probe in (
        ("u", "uprobe: gdbstub breakpoint, stepped in place, Python handler",
         qprobe.Uprobe(path, offset, handler=lambda up, regs: regs.di)),
        ("ur", "uretprobe: breakpoints at the entry and the return address, Python handler",
         qprobe.Uretprobe(path, offset, ret_handler=lambda up, func, regs: regs.ax)),
    ):  # fmt: skip
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
            seconds, row_base = _paired(target, cmd.format(n=n_slow), on, off)
        finally:
            off()
        returns = f", {probe.nreturns // FAST_RUNS} returns" if isinstance(probe, qprobe.Uretprobe) else ""
        rows.append(("", Row(name, key, f"{what} ({probe.nmissed} missed{returns})", n_slow,
                             (probe.nhit or probe.nreturns) // FAST_RUNS, seconds, row_base / n_slow)))  # fmt: skip
    return rows


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


@contextmanager
def _plain_vm(args: argparse.Namespace, tcg_thread: str = "") -> Iterator[tuple[QemuProcess, GuestShell]]:
    """A second VM of the same image with nothing attached to its gdbstub, and its guest shell."""
    from qprobe.images import get_image

    img = get_image(args.image, fetch=False)
    qemu = QemuProcess(QemuConfig(kernel=img.kernel, initrd=img.initrd, disk=img.disk,
                                  disk_interface=img.disk_interface, cmdline=img.cmdline, smp=args.smp,
                                  memory=parse_memory(args.memory), tcg_thread=tcg_thread))  # fmt: skip
    try:
        qemu.wait_for_sockets()
        console = Console(qemu.console_path, alive=qemu.alive)
        try:
            shell = open_shell(console, qemu.shell_path, qemu.alive, 120)
            try:
                yield qemu, shell
            finally:
                shell.close()
        finally:
            console.close()
    finally:
        qemu.terminate()


def _gdb_rows(args: argparse.Namespace) -> list[Row]:
    """GDB 13 on the gdbstub of a second, qprobe-free VM: a Python ``gdb.Breakpoint.stop()`` reading one register."""
    if shutil.which("gdb") is None:
        return []
    rows = []
    with _plain_vm(args) as (qemu, console):
        for name, func, cmd, _fast, slow in WORKLOADS:
            n = max(slow * args.hits // 2000, 5)

            def timed(command: str) -> float:
                t = time.perf_counter()
                console.run(command, timeout=1800).check()
                return time.perf_counter() - t

            base = statistics.median(timed(cmd.format(n=n)) for _ in range(3)) / n
            addr = int(console.run(f"grep ' {func}$' /proc/kallsyms").check().output.split()[0], 16)
            with tempfile.NamedTemporaryFile("w", suffix=".py") as script:
                script.write(GDB_SCRIPT.format(addr=addr))
                script.flush()
                gdb = subprocess.Popen(["gdb", "-batch", "-nx", "-ex", "set pagination off", "-ex",
                                        f"target remote {qemu.gdb_path}", "-x", script.name],
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
                assert gdb.stdout is not None
                for line in gdb.stdout:  # the breakpoint is in and the guest runs again
                    if line.startswith("QPROBE-GDB-ARMED"):
                        break
                seconds = timed(cmd.format(n=n))
                gdb.send_signal(signal.SIGINT)
                out, _ = gdb.communicate(timeout=120)
            hits = int(next(x.split()[1] for x in out.splitlines() if x.startswith("QPROBE-GDB-HITS")))
            rows.append(Row(name, "gdb", "GDB 13, Python gdb.Breakpoint.stop() reading one register", n, hits,
                            seconds, base))  # fmt: skip
    return rows


GDB_SCRIPT = """
import gdb
class Hit(gdb.Breakpoint):
    hits = 0
    def stop(self):
        gdb.selected_frame().read_register("rdi")
        Hit.hits += 1
        return False
Hit("*{addr:#x}")
print("QPROBE-GDB-ARMED", flush=True)
try:
    gdb.execute("continue")
except gdb.error:
    pass  # interrupted
print("QPROBE-GDB-HITS", Hit.hits, flush=True)
gdb.execute("delete")
gdb.execute("detach")
"""


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
            sites.check_kprobe_address_safe(at + 5 if sites.ftrace_site(at) else at)
        except qprobe.QprobeError:
            continue
        out.append(name)
    return out


def _wait_for_optimizer(target: qprobe.Target, timeout: float = 60.0) -> float:
    """Wait while points are still queued for their jump (the ftrace selftests' wait_for_kprobe_optimizer).

    A point that a vCPU's interrupted context might return into stays an int3
    when register returns, and the optimizer's thread places its jump later
    (in one bench run, 1,047 of a batch of 1,246 points were held up so by
    one vCPU).  Returns the seconds waited.
    """
    start = time.monotonic()
    while time.monotonic() - start < timeout and any(
        p.opt is None and p.optimizing for p in list(target.kprobes.points.values())
    ):
        time.sleep(0.1)
    return time.monotonic() - start


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
    out = os.fdopen(write_end, "w", buffering=1)
    rows: list[tuple[str, str]] = []
    for lossy in (False, True):
        target.records_lossy = lossy
        waits_before, start_lines = target.record_waits(), lines[0]
        by_pid: dict[int, int] = {}

        def show(hit: EventHit, by_pid: dict[int, int] = by_pid) -> None:
            by_pid[hit.pid] = by_pid.get(hit.pid, 0) + 1
            print(hit.line(), file=out)

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
    out.close()
    reader.join(10)
    arch = target.arch
    rows.append(("largest burst held without waiting (record ring, per vCPU)",
                 f"{arch.ring_entries} records ({arch.ring_entries * arch.ring_entry_size // 1024} KiB)"))  # fmt: skip
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


def _cost(row: Row) -> float:
    """µs added per hit for comparing rows: a negative figure (the guest measured faster) is noise, 0."""
    return max(row.added_us, 0.0)


def _targets(rows: list[Row]) -> list[str]:
    """The project's performance targets, as ratios within this one run (per-hit costs below zero count as zero)."""
    by = {(r.workload, r.key): r for r in rows}
    fork, tight = WORKLOADS[0][0], WORKLOADS[1][0]
    out = ["Targets (from this run):", ""]

    def check(label: str, ok: bool | None, detail: str) -> None:
        out.append(f"- {'met' if ok else 'NOT met' if ok is not None else 'not measured'}: {label} ({detail})")

    o, gdb = by.get((fork, "o")), by.get((fork, "gdb"))
    # On the fork-heavy loop every call is a hit, so o's hits/s are capped by the unprobed loop's own call
    # rate (calls per iteration / unprobed seconds per iteration); the ratio to that cap is 1 / slowdown.
    ratio_gdb = f", {o.rate / gdb.rate:,.1f}x GDB's {gdb.rate:,.1f} hits/s" if o and gdb and gdb.rate else ""
    check(
        "`o`'s hits/s ≥ 0.85 of the unprobed fork-heavy loop's call rate",
        1 / o.slowdown >= 0.85 if o and o.slowdown else None,
        f"{o.rate:,.0f} of {o.hits / o.iterations / o.base:,.0f} calls/s = {1 / o.slowdown:.2f}{ratio_gdb}"
        if o and o.slowdown and o.base
        else "-",
    )
    for key, limit in (("o", 20.0), ("ro", 30.0)):
        row = by.get((tight, key))
        check(
            f"`{key}` ≤ {limit:.0f} µs per hit ({tight})",
            _cost(row) <= limit if row else None,
            f"{row.added_us:.1f} µs" if row else "-",
        )
    check(
        "`o` keeps the fork-heavy guest ≤ 1.3x unprobed",
        o.slowdown <= 1.3 if o else None,
        f"{o.slowdown:.2f}x" if o else "-",
    )
    for wl in (fork, tight):
        f, ke = by.get((wl, "f")), by.get((wl, "kprobe_events"))
        check(
            f"`f` keeps the guest ≤ 1.05x unprobed ({wl})",
            f.slowdown <= 1.05 if f else None,
            f"{f.slowdown:.2f}x" if f else "-",
        )
        check(
            f"`f` costs no more per hit than the guest's kprobe_events ({wl})",
            _cost(f) <= _cost(ke) if f and ke else None,
            f"{f.added_us:.1f} vs {ke.added_us:.1f} µs" if f and ke else "-",
        )
    f = by.get((tight, "f"))
    check(
        "`f` counts exactly the calls the guest made (lseek loop)",
        f.hits == f.iterations if f else None,
        f"{f.hits} of {f.iterations}" if f else "-",
    )
    for wl in (fork, tight):
        k, b = by.get((wl, "k")), by.get((wl, "b"))
        check(
            f"`b` costs ≤ 0.6x of `k` per hit ({wl})",
            b.added_us <= 0.6 * k.added_us if k and b else None,
            f"{b.added_us:,.0f} vs {k.added_us:,.0f} µs" if k and b else "-",
        )
        for slow, fast in (("k", "b"), ("r", "rb")):
            a, c = by.get((wl, slow)), by.get((wl, fast))
            check(
                f"`{slow}` ≤ 2x `{fast}` per hit ({wl})",
                _cost(a) <= 2 * _cost(c) if a and c else None,
                f"{a.added_us:,.0f} vs {c.added_us:,.0f} µs" if a and c else "-",
            )
        for rk, kk in (("r", "k"), ("rb", "b"), ("ro", "o"), ("rf", "f")):
            r, kp = by.get((wl, rk)), by.get((wl, kk))
            check(
                f"`{rk}` ≤ 2x `{kk}` per hit ({wl})",
                _cost(r) <= 2 * _cost(kp) if r and kp else None,
                f"{r.added_us:,.0f} vs {kp.added_us:,.0f} µs" if r and kp else "-",
            )
    return out


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


def run_bench(args: argparse.Namespace) -> int:
    rows: list[tuple[str, str | Row]] = []
    t0 = time.perf_counter()
    with qprobe.boot(args.image, smp=args.smp, memory=args.memory) as target:
        # -accel kvm wherever /dev/kvm works on a CPU with VMX/SVM (QemuProcess decides), else TCG.
        accel = target.qemu.accel if target.qemu is not None else "?"
        rows.append(("boot to guest shell (cached image)", f"{target.timings['boot']:.2f} s"))
        rows.append(("boot + attach (symbols, KASLR, journal)", f"{time.perf_counter() - t0:.2f} s"))
        vmlinux = target.symbols.path
        t = time.perf_counter()
        syms, _, _ = symbols_mod._parse_with_lief(vmlinux)
        rows.append((f"symbols, cold (LIEF parse, {len(syms)} symbols)", f"{time.perf_counter() - t:.2f} s"))
        t = time.perf_counter()
        symbols_mod.Symbols.load(vmlinux)
        rows.append(("symbols, cached by build-id", f"{time.perf_counter() - t:.2f} s"))

        gdb = target.gdb
        tid = target.machine.vcpus[0]
        addr = target.symbols.address("linux_banner")

        def stub_rtts() -> tuple[float, float]:
            g = _time(lambda: gdb.read_registers(tid), 300)
            gdb.set_physical(True)
            phys = target.mem.virt_to_phys(addr)
            return g, _time(lambda: gdb.read_memory(phys, 64), 300)

        g, m = target.machine.call(stub_rtts)
        rows.append(("gdbstub `g` round trip (all registers)", f"{g * 1e6:.0f} µs"))
        rows.append(("gdbstub `m` round trip (64 bytes)", f"{m * 1e6:.0f} µs"))
        served, shared = _time(lambda: target.machine.call(int), 200), _time(lambda: target.read(addr, 64), 3000)
        rows += [("a request while the VM runs (`Machine.call`: stop, serve, resume)", f"{served * 1e6:.0f} µs"),
                 ("shared-RAM read, 64 bytes (page walk included, VM running)", f"{shared * 1e6:.1f} µs")]  # fmt: skip
        t = time.perf_counter()
        first = target.add_event("p:qpbench_first vfs_read")  # the target's first: it finds the guest's clock
        rows.append(("first event armed (`add_event`, the guest's trace clock found)",
                     f"{time.perf_counter() - t:.2f} s"))  # fmt: skip
        target.remove_event(first)

        rows += _probe_matrix(target, args) + _uprobe_rows(target, args) if "probes" in args.sections else []
        rows += _trace_lines(target) if "trace" in args.sections else []
        wild = _wildcard_teardown(target) if "trace" in args.sections else None
        scale, scale_names = _scale(target, args) if "scale" in args.sections else ([], [])
    if scale_names:
        scale = sorted(scale + _guest_scale_rows(args, scale_names, accel), key=lambda row: row.n)
    teardown, teardown_targets = _teardown_rows(wild, _trace_ctrl_c(args) if "trace" in args.sections else None)
    rows += teardown
    gdb_rows = _gdb_rows(args) if "gdb" in args.sections else []
    report = [
        f"qprobe bench: {platform.node()}, {platform.machine()}, {os.cpu_count()} CPUs, -accel {accel}, "
        f"image {args.image}, smp {args.smp}, memory {args.memory}, {time.strftime('%Y-%m-%d %H:%M')}, "
        f"sections {','.join(args.sections)}, {time.perf_counter() - t0:.0f} s",
        "",
        "| measurement | result |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in rows if not isinstance(v, Row)],
        "",
        "Probe cost, as the kprobes documents tabulate it (host wall time; slowdown = the guest's time per "
        "iteration against unprobed):",
        "",
        "| workload | row | what | iterations | hits | hits/s | µs added per hit | guest slowdown |",
        "|---|---|---|---|---|---|---|---|",
        *[v.line() for _, v in rows if isinstance(v, Row)],
        *[v.line() for v in gdb_rows],
        "",
        *_targets([v for _, v in rows if isinstance(v, Row)] + gdb_rows),
        *_scale_targets(scale),
        *teardown_targets,
        "",
        f"Scale: N probes on distinct functions the fork-heavy loop reaches (hottest first; from the guest's "
        f"function tracer, those its kprobe_events accepts and qprobe optimizes); slowdown of {SCALE_ITERATIONS} "
        f"iterations ({SCALE_PY_ITERATIONS} for the Python rows) against the unprobed loop just before:",
        "",
        "| N | probes | register s | unregister s | guest slowdown | hits | host RSS MB | scratch KiB |",
        "|---|---|---|---|---|---|---|---|",
        *[r.line() for r in scale],
    ]
    text = "\n".join(report)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0
