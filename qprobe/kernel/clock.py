"""The guest's trace clock: what ftrace would stamp an event with, for a given cycle counter value.

ftrace stamps events with the clock its top-level instance is set to (``trace_clock``):
``local`` is ``sched_clock()``, which the architecture computes from its cycle counter
(``Arch.cycle_counter``'s ``sched_clock``: x86's ``native_sched_clock()`` scales the TSC by
the per-CPU ``cyc2ns``).  A kernel that finds its sched_clock unstable (a TCG guest's TSCs
are never synchronized) makes ``global`` the default (kernel/trace/trace.c, "Unstable clock
detected, switching default tracing clock"): ``sched_clock_cpu()``, the per-CPU clock that
kernel/sched/clock.c keeps within a tick of the time of day.  Reading the same state
from the guest turns the counter value that a hit carries into the timestamp the guest's
own trace would have printed for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import drgn

from qprobe.arch import CycleCounter, SchedClock, StopTimer
from qprobe.errors import QprobeError, TargetGone
from qprobe.kernel.program import KernelData
from qprobe.vmm.gdbremote import BREAK_HW

if TYPE_CHECKING:
    from qprobe.vmm.machine import Machine

NSEC_PER_SEC = 1_000_000_000
U64 = (1 << 64) - 1
RECALIBRATE_NS = 10 * NSEC_PER_SEC  # of guest time between two (counter, stop timer) pairs
RATE_BASELINE = 0.5  # seconds between the first two rounds of pairs, for the rate
ROUND = 3  # pairs per round: the least late one anchors
LATE_NS = 200_000  # a later anchor is kept if its pair came no later than this after the model's time
CALIBRATE_WAIT = 5.0  # seconds the first pair may take (sched_clock runs on every tick)
TICK_READS = 4  # reads of a CPU's tick pair until two agree (a tick stores it every 1/HZ s)


class KernelView:
    """The running kernel as the architecture's cycle counter facet reads it (``qprobe.arch.GuestKernel``)."""

    def __init__(self, kernel: KernelData) -> None:
        self.kernel = kernel

    @property
    def prog(self) -> drgn.Program:
        return self.kernel.prog

    def address(self, name: str) -> int | None:
        symbols = self.kernel.symbols
        return symbols.address(name) if name in symbols else None

    def symbolize(self, addr: int) -> str:
        return self.kernel.symbols.symbolize(addr)

    def read(self, addr: int, size: int) -> bytes:
        return self.kernel.mem.read(addr, size)


def cycles_hz(kernel: KernelData) -> int:
    """The cycle counter's rate by the guest kernel's own calibration (x86: ``tsc_khz``); 0: unknown."""
    counter = kernel.arch.cycle_counter
    return 0 if counter is None else counter.hz(KernelView(kernel))


class TraceClock:
    """sched_clock() of the guest, computed on the host from a cycle counter value and the CPU that read it."""

    def __init__(self, kernel: KernelData) -> None:
        self.kernel = kernel
        self._lock = threading.Lock()
        self._sched: SchedClock | None = None  # the architecture's sched_clock(), once checked
        self._why_not: str | None = None
        self._checked = False
        self.name = "local"  # the guest's trace clock
        self._scd: tuple[int, int, int] | None = None  # per-CPU sched_clock_data: (address, tick_raw, tick_gtod)
        self._addrs = (0, 0, 0)  # __sched_clock_stable's count, __sched_clock_offset, __gtod_offset
        self._percpu: list[int] = []  # __per_cpu_offset
        self._last: dict[int, tuple[int, int]] = {}  # cpu (-1: all) -> the newest (cycles, ns) converted

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
        counter = self.kernel.arch.cycle_counter
        if counter is None:
            return f"qprobe cannot compute {self.kernel.arch.name}'s sched_clock from a cycle counter"
        sched = counter.sched_clock(KernelView(self.kernel))
        if isinstance(sched, str):
            return sched
        self._sched = sched
        return self._check_trace_clock(prog)

    def _check_trace_clock(self, prog: drgn.Program) -> str | None:
        """Which clock the guest's trace uses; None if qprobe can compute it (local, or global/perf)."""
        try:
            tr = prog["global_trace"]
            self.name = prog["trace_clocks"][tr.clock_id].name.string_().decode()
        except (KeyError, LookupError, drgn.FaultError):
            return None  # no ftrace: sched_clock is the kernel's own notion of event time
        if self.name == "local":
            return None
        if self.name not in ("global", "perf"):
            return f"the guest's trace clock is {self.name!r}; qprobe computes 'local', 'global' and 'perf'"
        try:
            scd = prog["sched_clock_data"]
            self._scd = (scd.address_, drgn.offsetof(scd.type_, "tick_raw"), drgn.offsetof(scd.type_, "tick_gtod"))
            self._addrs = (prog["__sched_clock_stable"].key.enabled.address_, prog["__sched_clock_offset"].address_,
                           prog["__gtod_offset"].address_)  # fmt: skip
            self._percpu = [prog["__per_cpu_offset"][cpu].value_() for cpu in range(len(prog["__per_cpu_offset"]))]
        except (KeyError, LookupError, drgn.FaultError):
            self.name = "local"  # !CONFIG_HAVE_UNSTABLE_SCHED_CLOCK: sched_clock_cpu() is sched_clock()
        return None

    def _cpu_offset(self, cpu: int) -> int:
        """What sched_clock_cpu(cpu) adds to sched_clock() now (kernel/sched/clock.c), mod 2**64."""
        mem = self.kernel.mem

        def u64(addr: int) -> int:
            return int.from_bytes(mem.read(addr, 8), "little")

        stable, sched_offset, gtod_offset = self._addrs
        if int.from_bytes(mem.read(stable, 4), "little"):
            return u64(sched_offset)
        assert self._scd is not None
        base, raw_off, gtod_off = self._scd
        scd, lo = base + self._percpu[cpu], min(raw_off, gtod_off)
        span = max(raw_off, gtod_off) + 8 - lo
        # The vCPUs run while the host reads (a record's hit is converted later): the tick may store its two
        # fields between the host's reads of them, and a pair from two ticks is a whole tick off.  The
        # pair is read in one read, again until two reads agree.
        raw = mem.read(scd + lo, span)
        for _ in range(TICK_READS):
            again = mem.read(scd + lo, span)
            if again == raw:
                break
            raw = again
        tick_raw = int.from_bytes(raw[raw_off - lo : raw_off - lo + 8], "little")
        tick_gtod = int.from_bytes(raw[gtod_off - lo : gtod_off - lo + 8], "little")
        # sched_clock_local(): the time of day at the CPU's last tick plus sched_clock's advance since.
        # The host reads the tick after the hit (a record waits in its ring a few ms); the advance is
        # then negative, which the kernel's clamp never sees and which keeps the sum right.  The clamp's
        # ceiling (that tick's time of day plus one tick, where the clock stands while a tick is late)
        # is not computed: the tick it rests on has been replaced by the time the host reads it.
        return (tick_gtod + u64(gtod_offset) - tick_raw) & U64

    def ns(self, cycles: int, cpu: int) -> int:
        """Nanoseconds on the guest's trace clock for the cycle counter value ``cycles`` read on ``cpu``."""
        return self.ns_many([(cycles, cpu)])[0]

    def ns_many(self, points: Sequence[tuple[int, int]]) -> list[int]:
        """``ns`` of each (cycles, CPU), in order, what the guest's clock keeps in its memory read once a CPU
        for them all (a run of ring records): it is read after the hits either way, a few ms later."""
        assert self._sched is not None  # converting only once unavailable() said the clock can be computed
        out = self._sched.ns_many(points)
        if self.name == "local":
            return out
        offsets: dict[int, int] = {}
        for i, (_cycles, cpu) in enumerate(points):
            offset = offsets.get(cpu)
            if offset is None:
                offset = offsets[cpu] = self._cpu_offset(cpu)
            out[i] = (out[i] + offset) & U64
        # sched_clock_local() never goes back on a CPU (its clamp to scd->clock) and trace_clock_global()
        # never goes back at all (its prev_time), though the tick they start from moves under the host's
        # conversions: neither do these, for a later counter value.
        with self._lock:
            for i, (cycles, cpu) in enumerate(points):
                key = -1 if self.name == "global" else cpu
                last = self._last.get(key)
                if last is not None and cycles >= last[0]:
                    out[i] = max(out[i], last[1])
                if last is None or cycles >= last[0]:
                    self._last[key] = (cycles, out[i])
        return out


class StopClock:
    """The guest's cycle counter while the VM is stopped, which the gdbstub cannot read directly.

    QEMU stops the guest's clocks with the VM (``vm_stop`` calls ``cpu_disable_ticks``):
    its cycle counter and its virtual clock both stand still during a stop and run on
    together, so counter = a + b * virtual time throughout.  The architecture's stop timer
    (``CycleCounter.stop_timer``: x86's HPET) is that virtual clock as the gdbstub reads it;
    (a, b) come from pairs taken at a hardware breakpoint right after sched_clock's read of
    the counter (x86: the ``rdtsc`` in ``native_sched_clock``), where the registers hold the
    counter of that very stop: the rate from the first anchor and the newest, the offset
    from the newest (taken again every ten seconds of guest time).  QEMU stops the VM some
    time after the trap, so a stop's time is good to that latency (tens to hundreds of
    microseconds on a loaded two-core host), never earlier than the trap.

    An idle guest reads its clock a few times a second, so the calibration proper (two
    rounds of pairs RATE_BASELINE apart) takes seconds: it runs in the background, and
    until it ends one pair anchors the model at the rate of the guest's own calibration
    (``CycleCounter.hz``: x86's ``tsc_khz``).
    """

    def __init__(self, kernel: KernelData, machine: Machine) -> None:
        self.kernel = kernel
        self.machine = machine
        # ((cycles, timer ns) where the rate starts, the newest: the offset's anchor), replaced as one
        self._anchors: tuple[tuple[int, int], tuple[int, int]] | None = None
        self._nominal_rate = 0.0  # cycles per ns by the guest's own calibration: the rate while one pair is known
        self._taken: list[tuple[int, int]] = []  # pairs of the round being taken
        self._rounding = False
        self._armed = 0  # the breakpoint's address while it waits for a vCPU
        self._got = threading.Event()
        self._timer: StopTimer | None = None
        self._why_not: str | None = None
        self._site = 0
        self._counter: Callable[[Mapping[str, int]], int] | None = None  # the value read, from the registers

    def unavailable(self) -> str | None:
        """Why the guest's cycle counter at a stop cannot be known, or None; waits for one pair (one stop),
        once, and leaves the calibration proper to a thread of its own."""
        if self._why_not is None and self._anchors is None:
            self._why_not = self._prepare()
            if self._why_not is None:
                pair = self._round(1)
                if isinstance(pair, str):
                    self._why_not = pair
                else:
                    self._anchors = (pair, pair)
                    threading.Thread(target=self._calibrate, name="qprobe-stop-clock", daemon=True).start()
        return self._why_not

    def _calibrate(self) -> None:
        """The rate from the least late pairs of two rounds RATE_BASELINE apart, the offset from the later."""
        try:
            first = self._round(ROUND)
            if isinstance(first, str):
                return
            time.sleep(RATE_BASELINE)
            last = self._round(ROUND)
        except (QprobeError, TimeoutError):  # the target closed or the VM went meanwhile
            return
        if not isinstance(last, str):  # else the first pair's model stays, as for an idle guest
            self._anchors = (first, last)

    def _round(self, pairs: int) -> tuple[int, int] | str:
        """Take ``pairs`` pairs and return the least late; why not, if one did not come.

        A pair's timer time is read when QEMU has stopped, some time after the counter's read:
        the pair that implies the largest counter value for a given timer time waited least.
        """
        self._taken, self._rounding = [], True
        try:
            for _ in range(pairs):
                if not self.machine.alive:
                    raise TargetGone("the VM's stop loop has ended")
                self._got.clear()
                self.machine.call(self._arm)
                if not self._got.wait(CALIBRATE_WAIT):
                    self.machine.call(self._disarm)
                    return "no vCPU read the cycle counter in sched_clock to calibrate the clock against"
        finally:
            self._rounding = False
        return max(self._taken, key=lambda p: p[0] - self._nominal_rate * p[1])

    def _prepare(self) -> str | None:
        counter = self.kernel.arch.cycle_counter
        if counter is None:
            return f"qprobe cannot read {self.kernel.arch.name}'s cycle counter at a stop"
        symbols, mem = self.kernel.symbols, self.kernel.mem
        if counter.function not in symbols:
            return f"this kernel has no {counter.function} to time stops with"
        timer = self._stop_timer(counter)
        if isinstance(timer, str):
            return timer
        fn = symbols.lookup(counter.function)
        site = counter.after_read(mem.read(fn.addr, fn.size), fn.addr)
        if site is None:
            return f"{counter.function} reads no cycle counter to calibrate the clock against"
        hz = counter.hz(KernelView(self.kernel))
        if not hz:
            return "the guest kernel has no rate of its cycle counter to time stops with"
        self._counter = counter.value
        self._timer, self._site = timer, site
        self._nominal_rate = hz / NSEC_PER_SEC
        return None

    def _stop_timer(self, counter: CycleCounter) -> StopTimer | str:
        guest = KernelView(self.kernel)
        result: StopTimer | str = self.machine.call(lambda: counter.stop_timer(guest, self._read_phys))
        return result

    def _read_phys(self, addr: int, size: int) -> bytes:
        gdb = self.machine.gdb
        gdb.set_physical(True)
        try:
            return gdb.read_memory(addr, size)
        finally:
            gdb.set_physical(False)

    def _timer_ns(self) -> int:
        assert self._timer is not None
        return self._timer.ns()

    def _arm(self) -> None:
        if not self._armed:
            self.machine.gdb.insert_breakpoint(self._site, BREAK_HW)
            self.machine.stop_handlers[self._site] = self._on_read
            self._armed = self._site

    def _disarm(self) -> None:
        if self._armed:
            self.machine.stop_handlers.pop(self._armed, None)
            self.machine.gdb.remove_breakpoint(self._armed, BREAK_HW)
            self._armed = 0

    def _on_read(self, thread: str, regs: dict[str, int]) -> None:
        assert self._counter is not None  # armed only once _prepare found the read
        cycles = self._counter(regs)
        pair = (cycles, self._timer_ns())
        self._disarm()
        anchors = self._anchors
        if not self._rounding and anchors is not None:
            # A fresh anchor between rounds: kept unless it came later than the model allows.
            if cycles >= self._predict(pair[1]) - self.rate() * LATE_NS:
                self._anchors = (anchors[0], pair)
        else:
            self._taken.append(pair)
        self._got.set()

    def rate(self) -> float:
        """Cycles per nanosecond of the guest's virtual time (both run off the host's clocks)."""
        assert self._anchors is not None
        return self._rate_of(self._anchors)

    def _rate_of(self, anchors: tuple[tuple[int, int], tuple[int, int]]) -> float:
        (c0, v0), (c1, v1) = anchors
        return (c1 - c0) / (v1 - v0) if v1 - v0 > 0 else self._nominal_rate

    def _predict(self, timer_ns: int) -> int:
        anchors = self._anchors  # one model, though the calibration's thread may replace it meanwhile
        assert anchors is not None
        c0, v0 = anchors[1]
        return c0 + round((timer_ns - v0) * self._rate_of(anchors))

    def cycles(self) -> int | None:
        """The guest's cycle counter now, or None if unknown (in a stop's handler, the counter of that stop)."""
        if self._anchors is None or self._timer is None:
            return None
        return self.machine.call(self._cycles_stopped)  # inline on the stop loop's thread; else one stop

    def _cycles_stopped(self) -> int:
        now = self._timer_ns()
        assert self._anchors is not None
        if now - self._anchors[1][1] > RECALIBRATE_NS:
            self._arm()  # a fresh anchor at the next sched_clock; this stop still uses the last one
        return self._predict(now)


__all__ = ["NSEC_PER_SEC", "KernelView", "StopClock", "TraceClock", "cycles_hz"]
