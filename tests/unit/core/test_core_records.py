"""The record rings (qprobe.core.records): validated, drained oldest first, delivered to the recorders.

The rings are laid out by the real x86_64 arch in a flat fake of guest RAM;
the entries are written as the record stub writes them (its frame, then
the TSC, CPU and pid, comm and task at the arch's offsets).
"""

from __future__ import annotations

import struct
from types import SimpleNamespace

import pytest

from qprobe.arch.x86_64 import detour
from qprobe.arch.x86_64.arch import X86_64
from qprobe.arch.x86_64.guestram import X86GuestRam
from qprobe.arch.x86_64.ptregs import PT_REGS_ORDER, STUB_FRAME_ID
from qprobe.core.handlers import Handlers
from qprobe.core.kprobe import GuestRecord, Kprobe
from qprobe.core.point import Optimized, ProbePoint
from qprobe.core.records import RecordRings, Sink
from qprobe.errors import QprobeError

ARCH = X86_64()
RINGS = X86GuestRam()
SCRATCH = 0xFFFF_FFFF_C000_0000
PROBE = 0xFFFF_FFFF_8120_0004


class FakeRam:
    """Guest RAM at physical 0 upward; the scratch area maps to it one to one."""

    def __init__(self) -> None:
        self.data = bytearray(0x400000)

    def read_phys(self, phys: int, size: int) -> bytes:
        return bytes(self.data[phys : phys + size])

    def write_phys(self, phys: int, data: bytes) -> None:
        self.data[phys : phys + len(data)] = data

    def read_u64_phys(self, phys: int) -> int:
        return int.from_bytes(self.read_phys(phys, 8), "little")

    def write_u64_phys(self, phys: int, value: int) -> None:
        self.write_phys(phys, value.to_bytes(8, "little"))


class FakeScratch:
    base = SCRATCH
    size = 8 << 20  # qprobe's QEMU reserves 8 MiB

    def __init__(self, ram: FakeRam) -> None:
        self.ram, self.next = ram, SCRATCH

    def alloc(self, size: int, align: int = 16) -> int:
        at = -(-self.next // align) * align
        self.next = at + size
        return at

    def phys_of(self, addr: int) -> int:
        return addr - SCRATCH

    def write(self, addr: int, data: bytes) -> None:
        self.ram.write_phys(self.phys_of(addr), data)


def rings(by_id: dict[int, ProbePoint], retired: set[int], kb: int | None = None, ncpus: int = 2
          ) -> tuple[RecordRings, FakeRam]:  # fmt: skip
    ram = FakeRam()
    scratch = FakeScratch(ram)
    machine = SimpleNamespace(vcpus=[f"1.{n + 1}" for n in range(ncpus)])
    # A kernel without tsc_khz: records are timed by the host's clock as they are drained.
    kernel = SimpleNamespace(offsets=(0x20C00, 0x5A0, 0x5A4, 0x740), arch=ARCH, symbols=set())
    rr = RecordRings(ARCH, machine, scratch, ram, kernel, set(), Handlers(), by_id, retired)  # type: ignore[arg-type]
    if kb is not None:
        rr.set_buffer_size_kb(kb)
    percpu = SimpleNamespace(cpu_number=0x20C08, this_cpu_off=0x20C10, current_task=0x20C00)
    rr.ensure(SCRATCH + 0x3F0000, percpu, lambda addr, size: ram.write_phys(scratch.phys_of(addr), bytes(size)), 0xE9)  # type: ignore[arg-type]
    return rr, ram


def publish(
    rr: RecordRings, ram: FakeRam, cpu: int, probe_id: int, tsc: int, di: int, ring_cpu: int | None = None
) -> None:
    """An entry on ``ring_cpu``'s ring (its own CPU's unless told) that says it is from ``cpu``."""
    ring_cpu = cpu if ring_cpu is None else ring_cpu
    hdr = rr.scratch.phys_of(rr.rings + ring_cpu * RINGS.ring_header_size)
    head = ram.read_u64_phys(hdr + RINGS.ring_head)
    raw = bytearray(RINGS.ring_entry_size)
    struct.pack_into("<Q", raw, 8 * PT_REGS_ORDER.index("rdi"), di)
    struct.pack_into("<Q", raw, STUB_FRAME_ID, probe_id)
    struct.pack_into("<QQ", raw, detour.E_TSC, tsc, (100 + cpu) << 32 | cpu)
    raw[detour.E_COMM : detour.E_COMM + 16] = b"workload".ljust(16, b"\0")
    struct.pack_into("<Q", raw, detour.E_TASK, 0xFFFF_8880_0100_0000)
    base = rr.rings + RINGS.ring_header_size * len(rr.machine.vcpus) + ring_cpu * rr.entries * RINGS.ring_entry_size
    ram.write_phys(rr.scratch.phys_of(base + (head % rr.entries) * RINGS.ring_entry_size), bytes(raw))
    ram.write_u64_phys(hdr + RINGS.ring_head, head + 1)


def recording_point(kind: str = "record") -> tuple[ProbePoint, list[GuestRecord]]:
    got: list[GuestRecord] = []
    kp = Kprobe(addr=PROBE)
    kp.recorder = got.extend
    point = ProbePoint(PROBE, "f+0x4", None, [kp])  # type: ignore[arg-type]
    point.opt = Optimized(7, SCRATCH + 0x1000, 8, None, SCRATCH + 0x100A, kind, 0)  # type: ignore[arg-type]
    return point, got


def test_records_reach_the_recorder_oldest_first_across_cpus_with_the_probe_s_ip() -> None:
    point, got = recording_point()
    rr, ram = rings({7: point}, set())
    publish(rr, ram, 1, 7, tsc=300, di=3)
    publish(rr, ram, 0, 7, tsc=100, di=1)
    publish(rr, ram, 1, 7, tsc=200, di=2)
    rr.drain()
    assert [(r.values["rdi"], r.cpu, r.pid, r.comm) for r in got] == [(1, 0, 100, "workload"), (2, 1, 101, "workload"),
                                                                        (3, 1, 101, "workload")]  # fmt: skip
    assert all(r.values["rip"] == PROBE for r in got) and point.probes[0].nhit == 3
    assert rr.ring_errors == 0
    rr.drain()  # the tails moved: nothing twice
    assert len(got) == 3


def test_garbage_in_a_ring_is_counted_and_skipped_and_records_flow_on() -> None:
    point, got = recording_point()
    rr, ram = rings({7: point}, {9})
    hdr0 = rr.scratch.phys_of(rr.rings)
    ram.write_u64_phys(hdr0 + RINGS.ring_head, 10 * rr.entries)  # a head far past a full ring
    publish(rr, ram, 0, 7, tsc=1, di=1, ring_cpu=1)  # from CPU 0, on CPU 1's ring
    publish(rr, ram, 1, 8, tsc=2, di=2)  # a probe id nobody has
    publish(rr, ram, 1, 9, tsc=3, di=3)  # a probe unoptimized lately: late, not an error
    rr.drain()
    assert (rr.ring_errors, rr.late_records, got) == (3, 1, [])
    assert ram.read_u64_phys(hdr0 + RINGS.ring_tail) == 10 * rr.entries  # resynchronised
    publish(rr, ram, 1, 7, tsc=4, di=4)
    rr.drain()
    assert [r.values["rdi"] for r in got] == [4]


def test_a_point_that_no_longer_records_gets_no_records() -> None:
    point, got = recording_point("count")
    rr, ram = rings({7: point}, set())
    publish(rr, ram, 0, 7, tsc=1, di=1)
    rr.drain()
    assert got == [] and rr.ring_errors == 1 and point.probes[0].nhit == 0


def test_lossy_is_set_in_every_cpus_ring_and_waits_are_summed() -> None:
    """The host's switch and the guest's count of records that waited for a full ring, per CPU."""
    rr, ram = rings({}, set())
    headers = [rr.scratch.phys_of(rr.rings + cpu * RINGS.ring_header_size) for cpu in (0, 1)]
    assert not rr.lossy and rr.waits() == 0
    rr.set_lossy(True)
    assert [ram.read_u64_phys(h + RINGS.ring_lossy) for h in headers] == [1, 1]
    ram.write_u64_phys(headers[0] + RINGS.ring_waits, 3)  # as the record stub counts them
    ram.write_u64_phys(headers[1] + RINGS.ring_waits, 4)
    assert rr.waits() == 7
    rr.set_lossy(False)
    assert [ram.read_u64_phys(h + RINGS.ring_lossy) for h in headers] == [0, 0]


def test_a_ring_is_read_in_one_go_across_its_wrap_and_partly_filled_rings_too() -> None:
    """Records that wrap past a ring's end, one CPU's ring full and another's holding a few, come out
    whole, oldest first across CPUs, each probe's run in one recorder call; the tails follow the heads."""
    point, got = recording_point()
    calls: list[int] = []
    kp = point.probes[0]
    kp.recorder = lambda recs: (calls.append(len(recs)), got.extend(recs))  # type: ignore[func-returns-value]
    rr, ram = rings({7: point}, set(), kb=4, ncpus=3)  # 16 entries a CPU
    assert rr.entries == 16 and rr.size_kb == 4
    for n in range(10):  # the first ten of CPU 0's ring, drained: its tail is at 10
        publish(rr, ram, 0, 7, tsc=n, di=n)
    rr.drain()
    got.clear()
    for n in range(16):  # a full ring that wraps: entries 10..15, then 0..9
        publish(rr, ram, 0, 7, tsc=100 + 2 * n, di=100 + n)
    for n in range(3):
        publish(rr, ram, 2, 7, tsc=101 + 2 * n, di=200 + n)
    rr.drain()
    assert [(r.cpu, r.values["rdi"]) for r in got] == [
        (0, 100), (2, 200), (0, 101), (2, 201), (0, 102), (2, 202), *((0, 100 + n) for n in range(3, 16))]  # fmt: skip
    assert calls == [10, 19] and kp.nhit == 29 and rr.ring_errors == 0
    tails = [ram.read_u64_phys(rr.scratch.phys_of(rr.rings + cpu * RINGS.ring_header_size) + RINGS.ring_tail)
             for cpu in range(3)]  # fmt: skip
    assert tails == [26, 0, 3]


def test_runs_of_two_points_interleaved_keep_the_order_across_them() -> None:
    """Records of two probes interleaved in time go to each probe's recorder in runs, the calls in time order."""
    first, got1 = recording_point()
    second, got2 = recording_point()
    second.opt = Optimized(8, SCRATCH + 0x2000, 8, None, SCRATCH + 0x200A, "record", 0)  # type: ignore[arg-type]
    order: list[tuple[int, list[int]]] = []
    first.probes[0].recorder = lambda recs: order.append((7, [r.values["rdi"] for r in recs]))
    second.probes[0].recorder = lambda recs: order.append((8, [r.values["rdi"] for r in recs]))
    rr, ram = rings({7: first, 8: second}, set())
    for tsc, probe_id in ((1, 7), (2, 7), (3, 8), (4, 7)):
        publish(rr, ram, 0, probe_id, tsc=tsc, di=tsc)
    rr.drain()
    assert order == [(7, [1, 2]), (8, [3]), (7, [4])] and got1 == got2 == []


def test_the_ring_size_is_a_power_of_two_within_the_scratch_area_s_share() -> None:
    """buffer_size_kb per CPU, rounded down to a power of two of entries; the default the arch's; rings that
    would take more than half the scratch area are made smaller; a size is fixed once the rings are laid out."""
    rr, _ram = rings({}, set())
    assert rr.entries == RINGS.ring_entries and rr.size_kb == RINGS.ring_entries * RINGS.ring_entry_size // 1024
    assert rings({}, set(), kb=1408)[0].entries == 4096  # ftrace's default, 1.4 MB: 1 MiB of 256-byte entries
    assert rings({}, set(), kb=1)[0].entries == 4
    # Half of the 8 MiB: 2 CPUs' 2 MiB rings and their headers would pass it, 1 MiB ones fit.
    assert rings({}, set(), kb=1 << 20)[0].entries == 4096
    assert rings({}, set(), kb=1 << 20, ncpus=64)[0].entries == 128
    rr.set_buffer_size_kb(rr.size_kb)  # the size it has: fine
    with pytest.raises(QprobeError, match="laid out already"):
        rr.set_buffer_size_kb(64)
    with pytest.raises(QprobeError, match="at least 1"):
        RecordRings(ARCH, SimpleNamespace(vcpus=["1.1"]), None, None, None, set(), Handlers(), {}, set()  # type: ignore[arg-type]
                    ).set_buffer_size_kb(0)  # fmt: skip


def test_a_sink_s_records_keep_the_user_ip_and_function_they_were_taken_with_and_a_closed_one_s_are_late() -> None:
    """A uprobe handler's entry (qprobe.core.uguest) carries its own ip and, for a return, the probed function."""
    point, kprobe_got = recording_point()
    retired: set[int] = set()
    rr, ram = rings({7: point}, retired)
    got: list[GuestRecord] = []
    owner = SimpleNamespace(nfaults=0, errors=[])
    rr.sinks[12] = Sink(owner, got.extend)  # type: ignore[arg-type]
    for n, (tsc, ip) in enumerate(((100, 0x401136), (300, 0x7F00_0000_1234))):
        publish(rr, ram, 0, 12, tsc=tsc, di=5)
        entry = rr.scratch.phys_of(rr.rings + RINGS.ring_header_size * 2 + n * RINGS.ring_entry_size)  # CPU 0's
        ram.write_u64_phys(entry + 8 * PT_REGS_ORDER.index("rip"), ip)
        ram.write_u64_phys(entry + detour.E_FUNC, ip - 0x10)
    publish(rr, ram, 1, 7, tsc=200, di=9)
    rr.drain()
    assert [(r.values["rip"], r.func, r.values["rdi"]) for r in got] == [
        (0x401136, 0x401126, 5),
        (0x7F00_0000_1234, 0x7F00_0000_1224, 5),
    ]
    assert [r.values["rip"] for r in kprobe_got] == [PROBE] and rr.ring_errors == 0
    del rr.sinks[12]
    retired.add(12)
    publish(rr, ram, 0, 12, tsc=400, di=5)
    rr.drain()
    assert len(got) == 2 and rr.late_records == 1 and rr.ring_errors == 0


def test_a_sink_that_raises_is_counted_on_its_owner_and_the_ring_goes_on() -> None:
    rr, ram = rings({}, set())
    owner = SimpleNamespace(nfaults=0, errors=[])

    def deliver(records: list[GuestRecord]) -> None:
        raise ValueError("a handler of the user's")

    rr.sinks[3] = Sink(owner, deliver)  # type: ignore[arg-type]
    publish(rr, ram, 1, 3, tsc=10, di=1)
    rr.drain()
    assert owner.nfaults == 1 and "ValueError" in owner.errors[0]
    got: list[GuestRecord] = []
    rr.sinks[3] = Sink(owner, got.extend)  # type: ignore[arg-type]
    publish(rr, ram, 1, 3, tsc=20, di=2)
    rr.drain()
    assert [r.values["rdi"] for r in got] == [2]
