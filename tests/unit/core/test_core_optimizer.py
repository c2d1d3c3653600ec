"""The optimizer's decisions (qprobe.core.optimizer): which detour a point gets and when it may take the jump.

The function's bytes are decoded by the real x86_64 arch; the vCPUs are the
scripted QEMU 7.2 gdbstub's (tests/unit/vmm), their stacks a flat fake memory.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace

import drgn
import pytest
from core_fakes import ARCH, FlatMem, flat_regs
from vmm_fakes import QemuStub

from qprobe.arch.inguest import KeyPart, KeySpec
from qprobe.core import optcheck, optqueue
from qprobe.core.handlers import Handlers
from qprobe.core.kprobe import Kprobe, Kretprobe
from qprobe.core.optcheck import RESUME_GRACE, transient
from qprobe.core.optimizer import Optimizer, detour_kind
from qprobe.core.point import ProbePoint
from qprobe.core.regs import PtRegs
from qprobe.core.slots import Trampoline
from qprobe.vmm.gdbremote import GdbRemote

FN = 0xFFFF_FFFF_8120_0000
# push rbp; mov rbp, rsp; push rbx; push r12; mov eax, 1; pop r12; pop rbx; pop rbp; ret
CODE = bytes.fromhex("554889e5534154b801000000415c5b5dc3")
PROBE = FN + 4  # push rbx: the jump displaces push rbx; push r12; mov eax, 1 (8 bytes)
REGION = 8
TASK_STACK = 0xFFFF_C900_0001_0000
THREAD_SIZE = 0x4000
GS_BASE = 0xFFFF_8880_1F00_0000


class FakeKernel:
    """Per-CPU offsets, ``current`` and the stack size, as qprobe.kernel.program.KernelData gives them."""

    current_task_offset = 0x20C00
    symbols: frozenset[str] = frozenset()  # no linker-script symbols: THREAD_SIZE comes from the debug info

    def __init__(self) -> None:
        # THREAD_SIZE as qprobe.kernel.features.thread_size finds it: sizeof(init_stack).
        self.prog = drgn.Program(drgn.Platform(drgn.Architecture.X86_64, drgn.PlatformFlags.IS_64_BIT
                                               | drgn.PlatformFlags.IS_LITTLE_ENDIAN))  # fmt: skip
        stack = self.prog.array_type(self.prog.int_type("unsigned long", 8, False), THREAD_SIZE // 8)

        def find(prog: drgn.Program, name: str | None, flags: object, filename: str | None) -> drgn.Object:
            return drgn.Object(prog, stack, address=0xFFFF_FFFF_82C0_0000) if name == "init_stack" else None  # type: ignore[return-value]

        self.prog.register_object_finder("fake", find, enable_index=0)

    def percpu_offset(self, name: str) -> int:
        return {"cpu_number": 0x20C08, "this_cpu_off": 0x20C10, "current_task": 0x20C00}[name]

    def current(self, regs: Mapping[str, int]) -> SimpleNamespace:
        assert regs["gs_base"] == GS_BASE
        return SimpleNamespace(stack=SimpleNamespace(value_=lambda: TASK_STACK))


@dataclass
class Fn:
    addr: int = FN
    size: int = len(CODE)
    name: str = "f"


class Table:
    """The kprobes core as the optimizer reads it (qprobe.core.optimizer.KprobeParts), its ProbeTable and InsnSlots."""

    arch = ARCH
    fully_preemptible = False

    def __init__(self, machine: SimpleNamespace) -> None:
        self.machine = machine
        self.kernel = FakeKernel()
        self.symbols = SimpleNamespace(function=lambda addr: Fn() if FN <= addr < FN + len(CODE) else None,
                                       exception_table=lambda: None)  # fmt: skip
        self.scratch = SimpleNamespace(combined=contextlib.nullcontext)  # no writes reach it here
        self.handlers = Handlers()
        self.points: dict[int, ProbePoint] = {}
        self.trampolines: dict[int, Trampoline] = {}
        self.resume_targets: dict[int, float] = {}
        self.sites = SimpleNamespace(reserved=SimpleNamespace(conflict=lambda lo, hi: None))
        self.trapping: int | None = None
        self.stepping: dict[str, int] = {}
        # The table answers for its kernel text (KernelText: original, patched) and its dispatcher
        # (Dispatcher: arriving, trap_step_returns) and its slots (InsnSlots: quarantine) itself.
        self.text = self
        self.dispatcher = self
        self.slots = self

    def original(self, addr: int, size: int) -> bytes:
        return self.machine.mem.read(addr, size)

    def patched(self) -> dict[int, int]:
        return {p.addr: CODE[p.addr - FN] for p in self.points.values()}

    def quarantine(self, addr: int) -> None:
        pass

    def addresses(self) -> list[int]:
        return sorted(self.points)

    def make_regs(self, values: Mapping[str, int], tid: str) -> PtRegs:
        return flat_regs(values, tid, self.machine.mem)

    def arriving(self, regs: Mapping[str, int]) -> int | None:
        return self.trapping

    def trap_step_returns(self) -> dict[str, int]:
        return self.stepping


@dataclass
class Rig:
    stub: QemuStub
    table: Table
    opt: Optimizer
    mem: FlatMem
    point: ProbePoint = field(init=False)

    def __post_init__(self) -> None:
        self.point = self.probe(Kprobe(addr=PROBE))

    def probe(self, *probes: Kprobe, addr: int = PROBE) -> ProbePoint:
        prep = ARCH.arch_prepare_kprobe(CODE[addr - FN :].ljust(16, b"\x90"), addr, 0, "f", None)
        point = ProbePoint(addr, f"f+{addr - FN:#x}", prep, list(probes), int3=object())  # type: ignore[arg-type]
        self.table.points[addr] = point
        return point

    def vcpu(self, i: int, **regs: int) -> None:
        for name, value in {"cs": 0x10, "gs_base": GS_BASE, "rsp": TASK_STACK + 0x3F00, **regs}.items():
            self.stub.vcpus[i].set(name, value)


@pytest.fixture
def rig(stub_gdb: tuple[QemuStub, GdbRemote]) -> Iterator[Rig]:
    stub, gdb = stub_gdb
    mem = FlatMem()
    mem.fill(FN, CODE)
    table = Table(SimpleNamespace(gdb=gdb, mem=mem, vcpus=gdb.threads(), call=lambda fn: fn(),
                                  journal=SimpleNamespace(batch=contextlib.nullcontext)))  # fmt: skip
    opt = Optimizer(table, table, table, None, None)  # type: ignore[arg-type]
    opt.enabled = True  # as with a doorbell and shared RAM; no detour is built here
    r = Rig(stub, table, opt, mem)
    for i in range(len(stub.vcpus)):
        r.vcpu(i, rip=FN + 0x1000)
    yield r
    opt.close()


def recorder(rec: object) -> None:
    pass


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (lambda: [Kprobe(addr=PROBE)], "count"),
        (lambda: [Kprobe(addr=PROBE, pre_handler=lambda kp, regs: None)], "mailbox"),
        (lambda: [Kprobe(addr=PROBE, post_handler=lambda kp, regs: None)], "mailbox"),
        (lambda: [_with(Kprobe(addr=PROBE), recorder=recorder)], "record"),
        (lambda: [_with(Kprobe(addr=PROBE), recorder=recorder, guest_filter=object())], "filtered"),
        (lambda: [_with(Kprobe(addr=PROBE), recorder=recorder), _with(Kprobe(addr=PROBE), recorder=recorder,
                                                                       guest_filter=object())], "record"),
        (lambda: [_with(Kprobe(addr=PROBE), guest_key=KeySpec((KeyPart("reg", "di"),)))], "keyed"),
        (lambda: [_with(Kretprobe(addr=PROBE).kp)], "count"),  # no pool in guest RAM
        (lambda: [_pooled(Kretprobe(addr=PROBE))], "retentry"),
        (lambda: [_pooled(Kretprobe(addr=PROBE, entry_handler=lambda ri, regs: 0))], "count"),
    ],
    ids=["no handler", "pre_handler", "post_handler", "recorder", "filter", "two recorders", "key", "kretprobe",
         "kretprobe pool", "entry_handler"],
)  # fmt: skip
def test_detour_kind_follows_what_the_probes_need(make: object, kind: str) -> None:
    point = ProbePoint(PROBE, "f", None, make())  # type: ignore[arg-type, operator]
    assert detour_kind(point) == kind


def _with(kp: Kprobe, **attrs: object) -> Kprobe:
    for name, value in attrs.items():
        setattr(kp, name, value)
    return kp


def _pooled(rp: Kretprobe) -> Kprobe:
    rp.pool = object()  # type: ignore[assignment]
    return rp.kp


def test_a_plain_probe_may_take_the_jump_and_learns_its_region(rig: Rig) -> None:
    assert rig.opt.why_not(rig.point) is None
    assert rig.point.opt_size == REGION


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda r: setattr(r.opt, "enabled", False), "optimization is off"),
        (lambda r: r.point.probes.append(Kprobe(addr=PROBE, post_handler=lambda kp, regs: None)),
         "a probe there has a post_handler"),
        (lambda r: r.probe(Kprobe(addr=PROBE + 1), addr=PROBE + 1), "another probe at f+0x5 is inside the bytes"),
        (lambda r: r.table.resume_targets.update({PROBE + 3: math.inf}), "out-of-line code returns into the region"),
        (lambda r: setattr(r.point, "int3", None), "not armed with an int3"),
    ],
    ids=["knob off", "post_handler", "probe inside", "detour returns inside", "disarmed"],
)  # fmt: skip
def test_what_keeps_a_point_an_int3(rig: Rig, change: object, reason: str) -> None:
    change(rig)  # type: ignore[operator]
    why = rig.opt.why_not(rig.point)
    assert why is not None and why.startswith(reason) and not transient(why)


@pytest.mark.parametrize(
    ("change", "start"),
    [
        (lambda r: r.vcpu(1, rip=PROBE + 3), "vCPU"),
        (lambda r: setattr(r.table, "trapping", PROBE + 1), "vCPU"),
        (lambda r: r.table.stepping.update({"p1.2": PROBE + 1}), "vCPU"),
        (lambda r: r.table.resume_targets.update({PROBE + 3: time.monotonic()}), "a boosted copy"),
        (lambda r: r.mem.fill(TASK_STACK + 0x100, (PROBE + 3).to_bytes(8, "little")), "a context interrupted"),
        (lambda r: r.mem.fill(TASK_STACK + 0x3F10, (PROBE + 7).to_bytes(8, "little")), "a context interrupted"),
    ],
    ids=["vCPU inside", "trap arriving", "trap-step returning", "boosted copy just now", "task stack", "running stack"],
)  # fmt: skip
def test_what_only_delays_the_jump(rig: Rig, change: object, start: str) -> None:
    change(rig)  # type: ignore[operator]
    why = rig.opt.why_not(rig.point)
    assert why is not None and why.startswith(start) and transient(why)


def test_a_task_preempted_inside_the_region_delays_the_jump_on_a_fully_preemptible_kernel(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    stacks = [PROBE - 1, PROBE, PROBE + REGION, 2**64 - 1]  # around the region only
    reads: list[int] = []

    def preempted_words(kernel: object, stack_size: int) -> list[int]:
        reads.append(stack_size)
        return sorted(stacks)

    monkeypatch.setattr(optcheck, "preempted_words", preempted_words)
    assert rig.opt.why_not(rig.point) is None and reads == []  # not fully preemptible: no look at the tasks
    rig.table.fully_preemptible = True
    assert rig.opt.why_not(rig.point) is None and reads == [THREAD_SIZE]
    stacks.append(PROBE + 3)  # a saved ip in the displaced instructions
    rig.opt.check.preempted = None  # a new VM stop
    why = rig.opt.why_not(rig.point)
    assert why == f"a preempted task's stack holds {PROBE + 3:#x}, inside the region" and transient(why)
    assert rig.opt.check.preempted_in(PROBE + 3, PROBE + 4) == f"a preempted task's stack holds {PROBE + 3:#x}"
    assert rig.opt.check.preempted_in(PROBE + 4, PROBE + REGION) is None


def test_a_task_preempted_in_a_boosted_copy_returning_into_the_region_delays_the_jump(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, size = 0xFFFF_FFFF_C000_0000, 0x20_0000
    rig.table.scratch = SimpleNamespace(mapped=True, base=base, mapped_size=size)  # type: ignore[assignment]
    rig.table.fully_preemptible = True
    stacks = [base - 8, base + size]
    monkeypatch.setattr(optcheck, "preempted_words", lambda kernel, stack_size: sorted(stacks))
    rig.table.resume_targets[PROBE + 3] = time.monotonic() - RESUME_GRACE - 0.01  # a boosted copy returns there
    assert rig.opt.why_not(rig.point) is None
    stacks.append(base + 0x40)  # a task preempted in a slot
    rig.opt.check.preempted = None
    why = rig.opt.why_not(rig.point)
    assert why is not None and why.startswith(f"a preempted task's stack holds {base + 0x40:#x}")
    assert transient(why)
    rig.table.resume_targets.clear()  # no out-of-line code returns into this region: the slot's task does not matter
    rig.opt.check.preempted = None
    assert rig.opt.why_not(rig.point) is None


def test_a_boosted_copy_stops_delaying_after_the_grace_period(rig: Rig) -> None:
    rig.table.resume_targets[PROBE + 3] = time.monotonic() - RESUME_GRACE - 0.01
    assert rig.opt.why_not(rig.point) is None


def test_a_kernel_whose_stack_size_is_unknown_keeps_its_int3s_and_says_why(rig: Rig) -> None:
    """No init_stack in the debug info, no init stack span: a missing fact, not retried (6.12 was one for a while)."""
    rig.table.kernel.prog = drgn.Program(rig.table.kernel.prog.platform)
    why = rig.opt.why_not(rig.point)
    assert why is not None and why.startswith("interrupted contexts cannot be found: the size of a kernel stack")
    assert not transient(why)


def test_a_return_address_at_the_regions_start_or_end_is_harmless(rig: Rig) -> None:
    for at, value in ((TASK_STACK + 0x100, PROBE), (TASK_STACK + 0x108, PROBE + REGION)):
        rig.mem.fill(at, value.to_bytes(8, "little"))
    assert rig.opt.why_not(rig.point) is None


def test_a_vcpu_on_an_irq_stack_that_ends_at_a_guard_page_is_read_up_to_it(rig: Rig) -> None:
    """6.1's IRQ stacks are vmapped page-aligned: the THREAD_SIZE boundary above sp can lie past their guard page."""
    irq_top = 0xFFFF_C900_0030_1000
    rig.mem.unmapped.add(irq_top)
    for i in range(len(rig.stub.vcpus)):
        rig.vcpu(i, rsp=irq_top - 0x180)
    assert rig.opt.why_not(rig.point) is None
    rig.mem.fill(irq_top - 0x10, (PROBE + 3).to_bytes(8, "little"))  # an interrupted context's ip, on the IRQ stack
    why = rig.opt.why_not(rig.point)
    assert why is not None and why.startswith("a context interrupted") and transient(why)
    rig.mem.unmapped.add(irq_top - 0x1000)  # the page sp is on: nothing can be read
    why = rig.opt.why_not(rig.point)
    assert why is not None and why.startswith("a context interrupted") and transient(why)


def test_an_irq_stack_is_read_past_the_thread_size_boundary_above_sp(rig: Rig) -> None:
    """Only page-aligned: its older frames, near its top, lie above the THREAD_SIZE boundary above sp."""
    irq_top = 0xFFFF_C900_0030_6000  # 16 KiB from 0x...302000: not THREAD_SIZE-aligned
    rig.mem.unmapped.add(irq_top)
    for i in range(len(rig.stub.vcpus)):
        rig.vcpu(i, rsp=0xFFFF_C900_0030_2F00)  # its THREAD_SIZE boundary is 0x...304000
    assert rig.opt.why_not(rig.point) is None
    rig.mem.fill(irq_top - 0x40, (PROBE + 3).to_bytes(8, "little"))  # a caller inside the region, 2 pages up
    why = rig.opt.why_not(rig.point)
    assert why is not None and why.startswith("a context interrupted") and transient(why)


def test_a_vcpu_in_user_mode_holds_no_kernel_context(rig: Rig) -> None:
    rig.mem.fill(TASK_STACK + 0x100, (PROBE + 3).to_bytes(8, "little"))
    for i in range(len(rig.stub.vcpus)):
        rig.vcpu(i, cs=0x33, rip=0x401000)
    assert rig.opt.why_not(rig.point) is None


def test_a_jump_that_would_cross_a_page_is_refused(rig: Rig) -> None:
    fn = FN + 0xFF8  # the probe 4 bytes before a page boundary: its jump would end on the next page
    rig.mem.fill(fn, CODE)
    rig.table.symbols.function = lambda addr: Fn(addr=fn) if fn <= addr < fn + len(CODE) else None
    rig.table.points.clear()
    point = rig.probe(Kprobe(addr=fn + 4), addr=fn + 4)
    point.prep = ARCH.arch_prepare_kprobe(CODE[4:].ljust(16, b"\x90"), fn + 4, 0, "f", None)
    rig.table.patched = lambda: {}  # type: ignore[method-assign]
    assert rig.opt.why_not(point) == "the jump would cross a page"


def test_why_not_kept_sends_a_point_back_when_its_handlers_change(rig: Rig) -> None:
    assert rig.opt.why_not_kept(rig.point) is None
    rig.point.opt = SimpleNamespace(kind="count")  # type: ignore[assignment]
    rig.point.probes[0].pre_handler = lambda kp, regs: None
    assert rig.opt.why_not_kept(rig.point) == "its probes' handlers changed"


@pytest.mark.parametrize(
    ("reasons", "attempts"),
    [
        (["vCPU p1.02 is inside the region", "a boosted copy returning into the region ran 0.1 s ago or less"], 3),
        (["a probe there has a post_handler"], 1),  # not a moment's obstacle: dropped from the queue
        # Still held up after the rounds before register returns: the optimizer thread's later rounds.
        (["vCPU p1.02 is inside the region"] * 9, 10),
    ],
    ids=["delayed twice", "refused", "later rounds"],
)
def test_the_optimizer_works_its_queue_in_rounds(rig: Rig, monkeypatch: pytest.MonkeyPatch, reasons: list[str],
                                                 attempts: int) -> None:  # fmt: skip
    monkeypatch.setattr(optqueue, "OPTIMIZE_DELAY", 0.0)
    monkeypatch.setattr(optqueue, "RESUME_GRACE", 0.0)
    monkeypatch.setattr(optcheck, "RESUME_GRACE", 0.0)
    tried: list[tuple[bool, list[int]]] = []

    def optimize(point: ProbePoint) -> bool:
        tried.append((point.optimizing, list(rig.opt.queue.optimizing_list)))
        if len(tried) <= len(reasons):
            point.not_optimized = reasons[len(tried) - 1]
            return False
        return True

    monkeypatch.setattr(rig.opt.queue, "optimize", optimize)
    rig.opt.optimize_later([PROBE])
    if attempts > optqueue.OPTIMIZE_RETRIES:
        assert len(tried) >= optqueue.OPTIMIZE_RETRIES  # register returned; the point stays queued
        deadline = time.monotonic() + 10
        while rig.opt.queue.optimizing_list and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(tried) == attempts
    assert all(flag and queue == [PROBE] for flag, queue in tried)  # queued, and stepped rather than boosted
    assert not rig.point.optimizing and not rig.opt.queue.optimizing_list


def test_the_optimizer_does_nothing_with_the_knob_off(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    rig.opt.enabled = False
    monkeypatch.setattr(rig.opt.queue, "optimize", lambda point: pytest.fail("optimized with the knob off"))
    rig.opt.optimize_later([PROBE])
    assert not rig.point.optimizing
