"""The host's half of ``qprobe trace`` to a pipe, without a VM: ring records to lines, for docs/performance.md.

Lays out two CPUs' record rings in a bytearray standing for guest RAM, fills
them exactly as the record stub writes them (its frame, the TSC, CPU and
pid, comm and task at the arch's offsets; the head published last, wrapping
round the ring) with hits of ``p:rd ksys_read fd=%di:s32 count=%dx:u64``,
and runs the real path on them: ``RecordRings.drain``, the event's recorder,
the timeline and ``qprobe trace``'s line writer, into a pipe that ``wc -l``
reads.  The symbols and the guest's clock are stand-ins (the TSC over 2 GHz).
Filling the rings is not timed; lines per second are given by the wall clock
and by the process's CPU time (the steady figure on a shared machine).

    PYTHONPATH=. .venv/bin/python scripts/bench-trace-lines.py [RECORDS] [--per N] [--profile]

``--per N`` drains N records a CPU at a time (default: a full ring).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import struct
import subprocess
import sys
import time
from types import SimpleNamespace

from qprobe.arch.x86_64 import detour
from qprobe.arch.x86_64.arch import X86_64
from qprobe.arch.x86_64.ptregs import PT_REGS_ORDER, STUB_FRAME_ID, X86_EFLAGS_IF
from qprobe.cli.output import _Trace
from qprobe.cli.trace import LINES_GC_THRESHOLD
from qprobe.core.handlers import Handlers
from qprobe.core.point import Optimized, ProbePoint
from qprobe.core.records import RecordRings
from qprobe.core.regs import PtRegs
from qprobe.events import InOrder, KprobeEvent
from qprobe.events.lines import InOrderLines
from qprobe.events.timeline import Timeline
from qprobe.fetch import ProbeEvent, parse_event

ARCH = X86_64()
RINGS = ARCH.guest_ram
assert RINGS is not None
SCRATCH, PROBE, FUNC = 0xFFFF_FFFF_C000_0000, 0xFFFF_FFFF_8120_0004, 0xFFFF_FFFF_8120_0000
NCPUS, PROBE_ID = 2, 7
DEFINITION = "p:rd ksys_read fd=%di:s32 count=%dx:u64"
MEM = SimpleNamespace(pgd=0x1000, pgd_of=lambda root: root, paging=SimpleNamespace(task_size_max=lambda: 1 << 47))


class Ram:
    """Guest RAM from physical 0; the scratch area maps to it one to one."""

    def __init__(self, size: int) -> None:
        self.data = bytearray(size)
        self.view = memoryview(self.data)

    def read_phys(self, phys: int, size: int) -> bytes:
        return self.view[phys : phys + size].tobytes()

    def write_phys(self, phys: int, data: bytes) -> None:
        self.data[phys : phys + len(data)] = data

    def read_u64_phys(self, phys: int) -> int:
        return int.from_bytes(self.view[phys : phys + 8], "little")

    def write_u64_phys(self, phys: int, value: int) -> None:
        self.write_phys(phys, value.to_bytes(8, "little"))


class Scratch:
    base, size = SCRATCH, 8 << 20  # qprobe's QEMU reserves 8 MiB

    def __init__(self, ram: Ram) -> None:
        self.ram, self.next = ram, SCRATCH

    def alloc(self, size: int, align: int = 16) -> int:
        at = -(-self.next // align) * align
        self.next = at + size
        return at

    def phys_of(self, addr: int) -> int:
        return addr - SCRATCH

    def write(self, addr: int, data: bytes) -> None:
        self.ram.write_phys(self.phys_of(addr), data)


class Symbols:
    def containing(self, addr: int) -> SimpleNamespace | None:
        return SimpleNamespace(name="ksys_read", addr=FUNC) if FUNC <= addr < FUNC + 0xA0 else None

    def kallsyms_size(self, sym: object) -> int:
        return 0xA0

    def symbolize(self, addr: int) -> str:
        return f"ksys_read+{addr - FUNC:#x}"

    def __contains__(self, name: str) -> bool:
        return False


class Clock:
    def hit_time(self, regs: PtRegs, recorded: bool = False) -> tuple[float, float]:
        return (regs.cycles or 0) / 2e9, (regs.cycles or 0) / 2e9

    def record_times(self, records: list[tuple[int, int]]) -> list[tuple[float, float]]:
        return [(cycles / 2e9, cycles / 2e9) for cycles, _vcpu in records]


class Kernel:
    """The running kernel as the rings and the event read it: its task offsets, no tsc_khz (records are timed
    by the stand-in clock), and the ring buffer's bound on a record (Linux 6.8's default sub-buffer)."""

    offsets = (0x20C00, 0x5A0, 0x5A4, 0x740)
    arch = ARCH
    symbols = Symbols()

    def event_length_limit(self) -> int | None:
        return 4056


class Backend:
    trampoline = None

    def make_regs(self, values: dict[str, int], cpu: int) -> PtRegs:
        return PtRegs(dict(values), f"1.{cpu + 1}", cpu, MEM, layout=ARCH.registers)  # type: ignore[arg-type]


def setup(out: io.TextIOBase) -> tuple[RecordRings, Ram, Timeline]:
    """The rings laid out, the event armed on them, its lines written as ``qprobe trace`` writes them to ``out``."""
    ram = Ram(0x600000)
    scratch = Scratch(ram)
    timeline = Timeline()
    kernel = Kernel()
    host = SimpleNamespace(arch=ARCH, symbols=Symbols(), timeline=timeline, mem=MEM, clock=Clock(),
                           kprobe_backend=Backend(), kernel=kernel)  # fmt: skip
    ev = parse_event(DEFINITION, symbol_exists=lambda name: True)
    assert isinstance(ev, ProbeEvent)
    te = KprobeEvent(host, ev)  # type: ignore[arg-type]
    te.make_probe()
    kp = te.probe
    assert kp is not None and kp.recorder is not None
    kp.at = kp.resolved = PROBE
    args = argparse.Namespace(format=None, json=False, map=None, filter=None, run=None, boot=False,
                              kernel_image=None, kernel_cmdline=None, attach=None)  # fmt: skip
    trace = _Trace(args)
    trace.tty = False
    sys.stdout = out  # where _Trace writes
    te.callback = InOrderLines(trace.show, trace.show_run) if trace.bulk else InOrder(trace.show)
    timeline.flushers.append(trace.flush)
    point = ProbePoint(PROBE, "ksys_read+0x4", None, [kp])  # type: ignore[arg-type]
    point.opt = Optimized(PROBE_ID, SCRATCH + 0x1000, 8, None, SCRATCH + 0x100A, "record", 0)  # type: ignore[arg-type]
    machine = SimpleNamespace(vcpus=[f"1.{n + 1}" for n in range(NCPUS)])
    rr = RecordRings(ARCH, machine, scratch, ram, kernel, Symbols(), Handlers(), {PROBE_ID: point}, set())  # type: ignore[arg-type]
    percpu = SimpleNamespace(cpu_number=0x20C08, this_cpu_off=0x20C10, current_task=0x20C00)
    rr.ensure(SCRATCH + 0x500000, percpu, lambda at, size: ram.write_phys(scratch.phys_of(at), bytes(size)), 0xE9)  # type: ignore[arg-type]
    return rr, ram, timeline


def entry(cpu: int, tsc: int, fd: int, count: int) -> bytes:
    """One ring entry as the record stub writes it."""
    raw = bytearray(RINGS.ring_entry_size)
    for name, value in (("rdi", fd), ("rdx", count), ("rsp", 0xFFFF_C900_0012_3F00), ("eflags", X86_EFLAGS_IF)):
        struct.pack_into("<Q", raw, 8 * PT_REGS_ORDER.index(name), value)
    struct.pack_into("<Q", raw, STUB_FRAME_ID, PROBE_ID)
    struct.pack_into("<QQ", raw, detour.E_TSC, tsc, (1000 + cpu) << 32 | cpu)
    raw[detour.E_COMM : detour.E_COMM + 16] = b"workload".ljust(16, b"\0")
    struct.pack_into("<Q", raw, detour.E_TASK, 0xFFFF_8880_0100_0000)
    return bytes(raw)


def fill(rr: RecordRings, ram: Ram, cpu: int, n: int, tsc: int) -> None:
    """``n`` entries on ``cpu``'s ring, wrapping round it, then its head (as the stub publishes it)."""
    hdr = rr.scratch.phys_of(rr.rings + cpu * RINGS.ring_header_size)
    head = ram.read_u64_phys(hdr + RINGS.ring_head)
    size = RINGS.ring_entry_size
    base = rr.scratch.phys_of(rr.rings + RINGS.ring_header_size * NCPUS + cpu * rr.entries * size)
    for i in range(n):
        at = base + (head + i) % rr.entries * size
        ram.data[at : at + size] = entry(cpu, tsc + i * NCPUS, 3, 1)
    ram.write_u64_phys(hdr + RINGS.ring_head, head + n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("records", type=int, nargs="?", default=60_000)
    parser.add_argument("--per", type=int, help="records drained a CPU at a time (default: a full ring)")
    parser.add_argument("--profile", action="store_true", help="cProfile the timed part, to stderr")
    opts = parser.parse_args()
    gc.set_threshold(*LINES_GC_THRESHOLD)  # as qprobe trace has it
    wc = subprocess.Popen(["wc", "-l"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert wc.stdin is not None and wc.stdout is not None
    rr, ram, timeline = setup(wc.stdin)  # type: ignore[arg-type]
    per = min(opts.per or rr.entries, rr.entries)
    profile = cProfile.Profile() if opts.profile else None
    wall = cpu = 0.0
    done, tsc = 0, 10**9
    while done < opts.records:
        n = max(1, min(per, (opts.records - done) // NCPUS))
        for c in range(NCPUS):
            fill(rr, ram, c, n, tsc + c)
        tsc += n * NCPUS
        t, c0 = time.perf_counter(), time.process_time()
        if profile is not None:
            profile.enable()
        rr.drain()
        if profile is not None:
            profile.disable()
        wall, cpu = wall + time.perf_counter() - t, cpu + time.process_time() - c0
        done += n * NCPUS
    t, c0 = time.perf_counter(), time.process_time()
    timeline.flush()
    wall, cpu = wall + time.perf_counter() - t, cpu + time.process_time() - c0
    timeline.close()
    wc.stdin.close()
    lines = int(wc.stdout.read())
    sys.stdout = sys.__stdout__
    print(f"{done} records, {lines} lines ({per} a CPU a drain, {NCPUS} CPUs, rings of {rr.entries}): "
          f"{done / wall:,.0f} lines/s, {done / cpu:,.0f} lines per CPU-second")  # fmt: skip
    if profile is not None:
        pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
