"""What every part of ``qprobe bench`` measures with.

Timing, the probe-cost row, the workloads, the paired runs, the optimizer's wait,
and a VM with nothing attached to compare with.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import qprobe
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


# The two workloads: (name, kernel function and the ones to take where it is not, guest command for N iterations,
# iterations fast / stopping)
WORKLOADS = (
    ("fork-heavy `cat /proc/version` loop", ("version_proc_show",),
     "i=0; while [ $i -lt {n} ]; do cat /proc/version >/dev/null; i=$((i+1)); done", 400, 40),
    # ksys_lseek, not __x64_sys_getppid: qprobe never writes a function's __fentry__ site (the guest's
    # ftrace owns it), and getppid's next instructions (push; call) cannot take a jump.  Debian's arm64
    # builds inline ksys_lseek into the syscall's wrapper.
    ("tight `workload lseek` loop", ("ksys_lseek", "__arm64_sys_lseek"), "workload lseek {n}", 20000, 400),
)  # fmt: skip


def workload_function(has: Callable[[str], bool], candidates: tuple[str, ...]) -> str:
    """The first of a workload's functions this kernel ``has`` (the first if it has none: its refusal names it)."""
    return next((name for name in candidates if has(name)), candidates[0])


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


@contextmanager
def _plain_vm(args: argparse.Namespace, tcg_thread: str = "") -> Iterator[tuple[QemuProcess, GuestShell]]:
    """A second VM of the same image with nothing attached to its gdbstub, and its guest shell."""
    from qprobe.images import get_image

    img = get_image(args.image, fetch=False)
    qemu = QemuProcess(QemuConfig(kernel=img.kernel, initrd=img.initrd, disk=img.disk,
                                  disk_interface=img.disk_interface, cmdline=img.cmdline, smp=args.smp,
                                  memory=parse_memory(args.memory), tcg_thread=tcg_thread, arch=img.arch))  # fmt: skip
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
