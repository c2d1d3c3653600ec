"""The guest's trace clock: what ftrace's default "local" clock reads for a given TSC value.

ftrace stamps an event with ``trace_clock_local()``, that is ``sched_clock()``, which
on x86 with a usable TSC is ``native_sched_clock()``: ``cycles_2_ns(rdtsc())`` with
the per-CPU ``cyc2ns`` scale (arch/x86/kernel/tsc.c, the latch-protected pair of
scales since Linux 4.16's "x86/tsc: Use seqcount_latch() for cyc2ns").  Reading the
same scale from the guest turns the TSC that qprobe's in-guest records carry into
the very timestamp the guest's own trace would have printed for them.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import drgn
from drgn.helpers.linux.percpu import per_cpu

from qprobe.arch.x86_64.tsc import after_rdtsc
from qprobe.errors import QprobeError, SymbolError
from qprobe.kernel.program import KernelData
from qprobe.vmm.gdbremote import BREAK_HW

if TYPE_CHECKING:
    from qprobe.vmm.machine import Machine

NSEC_PER_SEC = 1_000_000_000
# HPET registers (IA-PC HPET specification 1.0a, 2.3): capabilities (the period in fs in
# the high half), configuration (bit 0 enables the counter) and the main counter.
HPET_CAP, HPET_CFG, HPET_COUNTER, HPET_ENABLE = 0x000, 0x010, 0x0F0, 1
RECALIBRATE_NS = 5 * NSEC_PER_SEC  # of guest time between two (TSC, HPET) pairs
CALIBRATE_WAIT = 5.0  # seconds the first pair may take (sched_clock runs on every tick)


class TraceClock:
    """sched_clock() of the guest, computed on the host from a TSC value and the CPU that read it."""

    def __init__(self, kernel: KernelData) -> None:
        self.kernel = kernel
        self._lock = threading.Lock()
        self._scales: dict[int, tuple[int, int, int]] = {}  # cpu -> (mul, shift, offset)
        self._why_not: str | None = None
        self._checked = False

    def unavailable(self) -> str | None:
        """Why the guest's trace clock cannot be computed on the host, or None when it can."""
        if not self._checked:
            with self._lock:
                if not self._checked:
                    self._why_not = self._check()
                    self._checked = True
        return self._why_not

    def _check(self) -> str | None:
        try:
            prog = self.kernel.prog
        except QprobeError as exc:
            return f"the guest's trace clock needs the kernel's debug info ({exc})"
        try:
            prog["cyc2ns"]
        except KeyError:
            return "this kernel has no per-CPU cyc2ns (its sched_clock is not the TSC's)"
        # Without a usable TSC native_sched_clock() counts jiffies instead (__use_tsc off).
        try:
            if not prog["__use_tsc"].key.enabled.counter.value_():
                return "this kernel's sched_clock does not read the TSC (__use_tsc is off)"
        except (KeyError, LookupError):
            pass
        # A paravirtual sched_clock (kvm-clock under KVM, Xen, Hyper-V) replaces the TSC's:
        # since Linux 5.19 through the pv_sched_clock static call, before through pv_ops.
        native = self.kernel.symbols.address("native_sched_clock") if "native_sched_clock" in self.kernel.symbols else 0
        try:
            target = prog["__SCK__pv_sched_clock"].func.value_()
        except (KeyError, LookupError):
            try:
                target = prog["pv_ops"].time.sched_clock.value_()
            except (KeyError, LookupError):
                target = native
        if native and target != native:
            name = self.kernel.symbols.symbolize(target)
            return f"this kernel's sched_clock is {name}, not the TSC's native_sched_clock"
        return None

    def refresh(self) -> None:
        """Forget the scales read so far: the kernel rescales after refining the TSC's frequency."""
        with self._lock:
            self._scales.clear()

    def _scale(self, cpu: int) -> tuple[int, int, int]:
        scale = self._scales.get(cpu)
        if scale is None:
            try:
                c = per_cpu(self.kernel.prog["cyc2ns"], cpu)
                try:
                    seq = c.seq.seqcount.sequence.value_()
                except (AttributeError, LookupError):
                    seq = c.seq.sequence.value_()  # a plain seqcount before seqcount_latch_t (Linux 5.10)
                d = c.data[seq & 1]
                scale = (d.cyc2ns_mul.value_(), d.cyc2ns_shift.value_(), d.cyc2ns_offset.value_())
            except (drgn.FaultError, LookupError, AttributeError) as exc:
                raise SymbolError(f"cannot read the guest's cyc2ns scale of CPU {cpu}: {exc}") from None
            with self._lock:
                self._scales[cpu] = scale
        return scale

    def ns(self, tsc: int, cpu: int) -> int:
        """cycles_2_ns(tsc) on ``cpu``: nanoseconds on the guest's trace clock."""
        mul, shift, offset = self._scale(cpu)
        return (offset + ((tsc * mul) >> shift)) & ((1 << 64) - 1)


class StopClock:
    """The guest's TSC while the VM is stopped, which the gdbstub cannot read directly.

    QEMU stops the guest's clocks with the VM (``vm_stop`` calls ``cpu_disable_ticks``):
    its TSC and its virtual clock both stand still during a stop and run on together,
    so TSC = a + b * HPET-time throughout.  The HPET's main counter counts that virtual
    clock and the gdbstub reads it as device memory; (a, b) come from pairs taken at a
    hardware breakpoint right after the ``rdtsc`` in ``native_sched_clock``, where
    ``edx:eax`` hold the TSC of that very stop.  The guest's refined ``tsc_khz`` is the
    rate until a second pair gives a measured one.
    """

    def __init__(self, kernel: KernelData, machine: Machine) -> None:
        self.kernel = kernel
        self.machine = machine
        self._pairs: list[tuple[int, int]] = []  # (tsc, hpet ns), newest last
        self._armed = 0  # the breakpoint's address while it waits for a vCPU
        self._got = threading.Event()
        self._hpet: tuple[int, int] | None = None  # (physical base, period in fs)
        self._why_not: str | None = None
        self._site = 0

    def unavailable(self) -> str | None:
        """Why the guest's TSC at a stop cannot be known, or None; takes the first pair (one stop) once."""
        if self._why_not is None and not self._pairs:
            self._why_not = self._prepare()
            if self._why_not is None:
                self.machine.call(self._arm)
                if not self._got.wait(CALIBRATE_WAIT):
                    self.machine.call(self._disarm)
                    self._why_not = "no vCPU ran native_sched_clock's rdtsc to calibrate the clock against"
        return self._why_not

    def _prepare(self) -> str | None:
        symbols, mem = self.kernel.symbols, self.kernel.mem
        # The HPET's address comes from the ACPI HPET table, kept in hpet_address (arch/x86/kernel/hpet.c).
        if "hpet_address" not in symbols or "native_sched_clock" not in symbols:
            return "this kernel has no hpet_address or native_sched_clock to time stops with"
        base = int.from_bytes(mem.read(symbols.address("hpet_address"), 8), "little")
        if not base:
            return "the guest has no HPET to time stops with"
        cap, cfg = self.machine.call(lambda: (self._read_phys(base + HPET_CAP), self._read_phys(base + HPET_CFG)))
        period = cap >> 32
        if not period or period == 0xFFFFFFFF or not cfg & HPET_ENABLE:
            return "the guest's HPET counter is not running"
        fn = symbols.lookup("native_sched_clock")
        site = after_rdtsc(mem.read(fn.addr, fn.size), fn.addr)
        if site is None:
            return "native_sched_clock has no rdtsc to calibrate the clock against"
        self._hpet, self._site = (base, period), site
        return None

    def _read_phys(self, addr: int) -> int:
        gdb = self.machine.gdb
        gdb.set_physical(True)
        try:
            return int.from_bytes(gdb.read_memory(addr, 8), "little")
        finally:
            gdb.set_physical(False)

    def _hpet_ns(self) -> int:
        assert self._hpet is not None
        base, period = self._hpet
        return self._read_phys(base + HPET_COUNTER) * period // 1_000_000

    def _arm(self) -> None:
        if not self._armed:
            self.machine.gdb.insert_breakpoint(self._site, BREAK_HW)
            self.machine.stop_handlers[self._site] = self._on_rdtsc
            self._armed = self._site

    def _disarm(self) -> None:
        if self._armed:
            self.machine.stop_handlers.pop(self._armed, None)
            self.machine.gdb.remove_breakpoint(self._armed, BREAK_HW)
            self._armed = 0

    def _on_rdtsc(self, thread: str, regs: dict[str, int]) -> None:
        tsc = (regs["rdx"] & 0xFFFFFFFF) << 32 | regs["rax"] & 0xFFFFFFFF
        self._pairs = [*self._pairs[-1:], (tsc, self._hpet_ns())]
        self._disarm()
        self._got.set()

    def _rate(self) -> float:
        """TSC ticks per nanosecond of the guest's virtual time."""
        if len(self._pairs) == 2:
            (t0, v0), (t1, v1) = self._pairs
            if v1 - v0 >= NSEC_PER_SEC // 2:
                return (t1 - t0) / (v1 - v0)
        return int.from_bytes(self.kernel.mem.read(self.kernel.symbols.address("tsc_khz"), 4), "little") / 1e6

    def tsc(self) -> int | None:
        """The guest's TSC now, or None if unknown (in a stop's handler, the TSC of that stop)."""
        if not self._pairs or self._hpet is None:
            return None
        return self.machine.call(self._tsc_stopped)  # inline on the stop loop's thread; else one stop

    def _tsc_stopped(self) -> int:
        now = self._hpet_ns()
        tsc0, v0 = self._pairs[-1]
        if now - v0 > RECALIBRATE_NS:
            self._arm()  # a fresh pair at the next sched_clock; this stop still uses the last one
        return tsc0 + round((now - v0) * self._rate())


__all__ = ["NSEC_PER_SEC", "StopClock", "TraceClock"]
