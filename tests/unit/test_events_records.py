"""Ring records made hits in bulk (KprobeEvent's recorder): the same hits, line for line, as the path that
builds each hit's pt_regs and evaluates its definition generically (the int3 path's, and the rings' before)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace

import pytest
from events_fakes import MEM, Clock

from qprobe.arch.x86_64.arch import X86_64
from qprobe.arch.x86_64.ptregs import STUB_FRAME_REGS, X86_EFLAGS_IF
from qprobe.core.kprobe import GuestRecord, Kprobe
from qprobe.core.regs import PtRegs
from qprobe.errors import InvalidProbe
from qprobe.events import EventHit, KprobeEvent, Samples
from qprobe.events.lines import InOrderLines
from qprobe.events.timeline import Timeline
from qprobe.fetch import ProbeEvent, parse_event

ARCH = X86_64()
FUNC, SIZE = 0xFFFF_FFFF_8120_0000, 0xA0
PROBE = FUNC + 4


class Symbols:
    def containing(self, addr: int) -> SimpleNamespace | None:
        return SimpleNamespace(name="ksys_read", addr=FUNC) if FUNC <= addr < FUNC + SIZE else None

    def kallsyms_size(self, sym: object) -> int:
        return SIZE

    def symbolize(self, addr: int) -> str:
        return f"ksys_read+{addr - FUNC:#x}" if FUNC <= addr < FUNC + SIZE else f"{addr:#x}"

    def address(self, name: str) -> int:
        raise KeyError(name)


class Backend:
    trampoline = None

    def make_regs(self, values: dict[str, int], cpu: int) -> PtRegs:
        return PtRegs(dict(values), f"1.{cpu + 1}", cpu, MEM, layout=ARCH.registers)  # type: ignore[arg-type]


class Kernel:
    """The guest's ring buffer's bound on a record's length (None: this kernel's types cannot say)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit

    def event_length_limit(self) -> int | None:
        return self.limit


def event(definition: str, limit: int | None = 4056, arch: X86_64 = ARCH) -> KprobeEvent:
    host = SimpleNamespace(arch=arch, symbols=Symbols(), timeline=Timeline(), mem=MEM, clock=Clock(),
                           kprobe_backend=Backend(), kernel=Kernel(limit))  # fmt: skip
    ev = parse_event(definition, symbol_exists=lambda name: True)
    assert isinstance(ev, ProbeEvent)
    te = KprobeEvent(host, ev)  # type: ignore[arg-type]
    te.make_probe()
    assert isinstance(te.probe, Kprobe)
    te.probe.at = te.probe.resolved = PROBE
    return te


def records() -> list[GuestRecord]:
    """Records as RecordRings hands them on: the frame's registers, the probe's ip and the TSC."""
    out = []
    for n, (word, flags) in enumerate([(0, X86_EFLAGS_IF), (2**64 - 3, 0), (0x1_2345_6789_ABCD, X86_EFLAGS_IF),
                                       (FUNC + 0x10, 0x2), (0x80, X86_EFLAGS_IF)]):  # fmt: skip
        values = {name: (word + i) % 2**64 for i, name in enumerate(STUB_FRAME_REGS)}
        values.update(eflags=flags, rip=PROBE, cycles=1000 * n + 7)
        out.append(GuestRecord(values, n % 2, 100 + n, ["workload", "sh", "kworker/0:1"][n % 3], 0xFFFF8880, 0.0))
    return out


DEFINITIONS = [
    "p:rd ksys_read fd=%di:s32 count=%dx:u64",
    "p:rd ksys_read fd=%di:s32 count=%dx:u64 who=$comm",
    "p:rd ksys_read a=$arg1 b=$arg2:x32 c=$arg6:s8 d=%r15:u16 e=%ax:x64 f=%si",
    "p:rd ksys_read ip=%ip sp=$stack fl=%flags:x64 ox=%orig_ax:s64",
    'p:rd ksys_read bf=%ax:b3@4/32 sym=%di:symbol str=$comm:string imm=\\1234 s=\\"hi\\":string',
    "p:rd ksys_read",
]


@pytest.mark.parametrize("definition", DEFINITIONS)
def test_a_run_of_records_gives_the_hits_one_record_at_a_time_gives(definition: str) -> None:
    bulk, single = event(definition), event(definition)
    got: list[EventHit] = []
    expected: list[EventHit] = []
    bulk.callback, single.callback = got.append, expected.append
    assert bulk.in_guest and bulk.probe is not None and bulk.probe.recorder is not None
    bulk.probe.recorder(records())
    for rec in records():
        regs = single.backend.make_regs(rec.values, rec.cpu)
        single._record(regs, PROBE, None, None, task=(rec.pid, rec.comm))
    assert [h.line() for h in got] == [h.line() for h in expected]
    assert got == expected  # every field: arguments, symbol, times, irqs
    assert bulk.nhit == single.nhit == len(expected)


Prepare = Callable[[KprobeEvent, KprobeEvent], None]


def run_both(definition: str, limit: int | None, prepare: Prepare | None = None) -> tuple[KprobeEvent, KprobeEvent]:
    """``definition``'s event fed the records as a run (the rings' path) and one at a time (``_record``), each
    made ready by ``prepare(bulk, single)`` first."""
    bulk, single = event(definition, limit), event(definition, limit)
    if prepare is not None:
        prepare(bulk, single)
    assert bulk.probe is not None and bulk.probe.recorder is not None
    bulk.probe.recorder(records())
    for rec in records():
        single._record(single.backend.make_regs(rec.values, rec.cpu), PROBE, None, None, task=(rec.pid, rec.comm))
    bulk.host.timeline.flush()
    single.host.timeline.flush()
    return bulk, single


@pytest.mark.parametrize("masked", [False, True])
def test_both_paths_read_irqs_off_in_the_layout_s_sense(masked: bool) -> None:
    """The irqs-off column is RegisterLayout.irqs_disabled_flags of the flags register, on a run as one at a
    time: with the interrupt bit's sense turned around (set while masked, as arm64's PSTATE.I) so is the column."""
    arch = X86_64()
    arch.registers = replace(ARCH.registers, irq_masked_when_set=masked)
    bulk, single = event(DEFINITIONS[0], arch=arch), event(DEFINITIONS[0], arch=arch)
    got: list[EventHit] = []
    expected: list[EventHit] = []
    bulk.callback, single.callback = got.append, expected.append
    assert bulk.probe is not None and bulk.probe.recorder is not None
    bulk.probe.recorder(records())
    for rec in records():
        single._record(single.backend.make_regs(rec.values, rec.cpu), PROBE, None, None, task=(rec.pid, rec.comm))
    enabled = [bool(rec.values["eflags"] & X86_EFLAGS_IF) for rec in records()]
    assert [h.irqs_off for h in got] == [h.irqs_off for h in expected] == [on == masked for on in enabled]


@pytest.mark.parametrize("limit", [None, 4056, 48, 47, 44, 38])
def test_a_run_drops_the_records_too_long_for_the_guests_ring_buffer_as_one_at_a_time_does(limit: int | None) -> None:
    """A record longer than the guest's ring buffer takes leaves no line and counts as oversized, in a run as
    in ``_record``: here the head, two u64s and the string's __data_loc are 36 bytes, the comm ``"workload"``
    9 more, ``"sh"`` 3 and ``"kworker/0:1"`` 12: the five records are 45, 39, 48, 45 and 39 bytes long."""
    bulk, single = run_both("p:rd ksys_read a=%di:u64 b=%si:u64 who=$comm:string", limit)
    assert [h.line() for h in bulk.hits] == [h.line() for h in single.hits]
    assert (bulk.nhit, bulk.oversized) == (single.nhit, single.oversized)
    assert bulk.oversized == {None: 0, 4056: 0, 48: 0, 47: 1, 44: 3, 38: 5}[limit]


def test_a_run_without_strings_past_the_bound_leaves_no_line() -> None:
    bulk, single = run_both(DEFINITIONS[0], 20)  # the head (16) and the two arguments (4 + 8) are 28
    assert bulk.oversized == single.oversized == len(records())
    assert bulk.nhit == single.nhit == 0 and not bulk.hits


def test_a_filter_rejects_the_same_records() -> None:
    bulk, single = event(DEFINITIONS[0]), event(DEFINITIONS[0])
    from qprobe.events import event_filter

    for te in (bulk, single):
        te.filter = event_filter(te.definition, "fd < 0 || count == 0")
    assert bulk.probe is not None and bulk.probe.recorder is not None
    bulk.probe.recorder(records())
    for rec in records():
        single._record(single.backend.make_regs(rec.values, rec.cpu), PROBE, None, None, task=(rec.pid, rec.comm))
    assert (bulk.nhit, bulk.host_filtered) == (single.nhit, single.host_filtered)
    assert 0 < bulk.nhit < len(records())
    bulk.host.timeline.flush()
    single.host.timeline.flush()
    assert [h.line() for h in bulk.hits] == [h.line() for h in single.hits]


def test_an_in_order_callback_takes_the_hits_once_the_timeline_lets_them_go() -> None:
    """A plain callback gets a hit at the hit; an InOrder one once the timeline has put it in the guest's
    order (with the event's own ``hits``), across events: two events' runs come out interleaved by time."""
    from qprobe.events import InOrder

    first, second, plain = event(DEFINITIONS[0]), event(DEFINITIONS[0]), event(DEFINITIONS[0])
    second.host = plain.host = first.host  # one target: one timeline
    ordered: list[EventHit] = []
    at_hit: list[EventHit] = []
    first.callback = second.callback = InOrder(ordered.append)
    plain.callback = at_hit.append
    recs = records()
    for te, run in ((first, recs[::2]), (second, recs[1::2]), (plain, recs)):
        assert te.probe is not None and te.probe.recorder is not None
        te.probe.recorder(run)
    assert len(at_hit) == len(recs) and ordered == []  # held: none a window older than the newest
    first.host.timeline.flush()
    assert [h.pid for h in ordered] == [rec.pid for rec in recs]  # the two runs interleaved, by time
    assert ordered[::2] == list(first.hits) and ordered[1::2] == list(second.hits)


def printed(te: KprobeEvent, out: list[str]) -> None:
    """``te``'s lines to ``out`` as ``qprobe trace`` prints them: a run's in bulk, any other hit's one at a time."""
    te.callback = InOrderLines(
        lambda hit: out.append(hit.line() + "\n"), lambda run, a, b: out.append(run.text(a, b)[1])
    )


@pytest.mark.parametrize("monotone", [False, True])
@pytest.mark.parametrize("definition", [*DEFINITIONS, "p:rd ksys_read a=%di:u64 b=%si:u64 who=$comm:string"])
def test_a_printer_s_run_of_lines_is_byte_for_byte_the_lines_of_one_hit_at_a_time(
    definition: str, monotone: bool
) -> None:
    """The bulk lines (columns, heads and tails made once, the run one timeline entry) are EventHit.line's of
    the hits ``_record`` makes, in the same order, with the same times (moved forward under a monotone
    clock), the same records dropped as too long; counted in nhit, not kept in hits."""
    out: list[str] = []

    def prepare(bulk: KprobeEvent, single: KprobeEvent) -> None:
        bulk.host.timeline.monotone = single.host.timeline.monotone = monotone
        printed(bulk, out)

    bulk, single = run_both(definition, 47, prepare)
    assert "".join(out) == "".join(h.line() + "\n" for h in single.hits)
    assert (bulk.nhit, bulk.oversized) == (single.nhit, single.oversized) and not bulk.hits


def test_two_events_runs_of_lines_come_out_interleaved_by_time() -> None:
    first, second = event(DEFINITIONS[0]), event(DEFINITIONS[1])
    second.host = first.host  # one target: one timeline
    out: list[str] = []
    printed(first, out)
    printed(second, out)
    recs = records()
    for te, run in ((first, recs[::2]), (second, recs[1::2])):
        assert te.probe is not None and te.probe.recorder is not None
        te.probe.recorder(run)
    first.host.timeline.flush()
    lines = "".join(out).splitlines()
    assert [int(line.split("-")[1].split()[0]) for line in lines] == [rec.pid for rec in recs]
    assert [" who=" in line for line in lines] == [n % 2 == 1 for n in range(len(recs))]


def test_a_run_with_a_host_filter_is_made_hit_by_hit() -> None:
    from qprobe.events import event_filter

    te = event(DEFINITIONS[0])
    out: list[str] = []
    printed(te, out)
    te.filter = event_filter(te.definition, "fd < 0 || count == 0")
    assert te.probe is not None and te.probe.recorder is not None
    te.probe.recorder(records())
    te.host.timeline.flush()
    assert 0 < len(out) == te.nhit == len(te.hits) < len(records())
    assert out == [h.line() + "\n" for h in te.hits]


def test_a_run_s_times_are_what_hit_time_gives_each_record() -> None:
    """HitClock.record_times: each record's (trace-clock seconds, place) as hit_time gives it for the record's
    pt_regs, the trace clock asked once for the run."""
    from qprobe.events.clock import HitClock
    from qprobe.events.timeline import CycleOrder

    class Trace:
        runs = 0

        def ns(self, cycles: int, cpu: int) -> int:
            return 3 * cycles + cpu

        def ns_many(self, points: list[tuple[int, int]]) -> list[int]:
            self.runs += 1
            return [self.ns(cycles, cpu) for cycles, cpu in points]

    def clock() -> HitClock:
        c = HitClock.__new__(HitClock)
        c._guest, c._order, c._cycles_hz, c.trace_clock = True, CycleOrder(), 2e9, Trace()  # type: ignore[assignment]
        return c

    recs, one, run = records(), clock(), clock()
    expected = [one.hit_time(Backend().make_regs(r.values, r.cpu), recorded=True) for r in recs]
    assert run.record_times([(r.values["cycles"], r.cpu) for r in recs]) == expected
    assert run.trace_clock.runs == 1  # type: ignore[attr-defined]


# -- a ring handler (Target.ring_buffer): the same records as batches of typed values -----------------------


def sampled(definition: str) -> tuple[KprobeEvent, list[Samples]]:
    host = SimpleNamespace(arch=ARCH, symbols=Symbols(), timeline=Timeline(), mem=MEM, clock=Clock(),
                           kprobe_backend=Backend(), kernel=Kernel(4056))  # fmt: skip
    ev = parse_event(definition, symbol_exists=lambda name: True)
    assert isinstance(ev, ProbeEvent)
    got: list[Samples] = []
    te = KprobeEvent(host, ev, sample_cb=got.append)  # type: ignore[arg-type]
    te.make_probe()
    assert isinstance(te.probe, Kprobe)
    te.probe.at = te.probe.resolved = PROBE
    return te, got


@pytest.mark.parametrize("definition", DEFINITIONS)
def test_a_ring_handler_s_batch_holds_what_the_definition_evaluates_for_each_record(definition: str) -> None:
    te, got = sampled(definition)
    assert te.probe is not None and te.probe.recorder is not None
    te.probe.recorder(records())
    [batch] = got
    ev = te.definition
    expected = [ev.evaluate(te._record_context()(rec)) for rec in records()]  # the generic evaluation
    assert batch.args == {a.name: [vals[i] for vals in expected] for i, a in enumerate(ev.args)}
    recs = records()
    assert (batch.cpu, batch.pid, batch.comm) == ([r.cpu for r in recs], [r.pid for r in recs], [r.comm for r in recs])
    assert batch.ts == [t for t, _ in Clock().record_times([(r.values["cycles"], r.cpu) for r in records()])]
    assert len(batch) == te.nhit == len(records()) and not te.hits  # no EventHit made
    rows = list(batch)
    assert [r.args for r in rows] == [dict(zip([a.name for a in ev.args], v, strict=True)) for v in expected]


def test_a_ring_handler_s_columns_are_typed_as_the_definition_says() -> None:
    te, got = sampled("p:rd ksys_read fd=%di:s32 count=%dx:u64 c=%si:s8 x=%cx:x16 who=$comm")
    assert te.probe is not None and te.probe.recorder is not None
    te.probe.recorder(records())
    args, recs = got[0].args, records()

    def signed(word: int, bits: int) -> int:
        word &= (1 << bits) - 1
        return word - (1 << bits) if word >> (bits - 1) else word

    assert args["fd"] == [signed(r.values["rdi"], 32) for r in recs] and min(args["fd"]) < 0  # type: ignore[type-var]
    assert args["count"] == [r.values["rdx"] for r in recs] and max(args["count"]) >= 2**63  # type: ignore[type-var]
    assert args["c"] == [signed(r.values["rsi"], 8) for r in recs]
    assert args["x"] == [r.values["rcx"] & 0xFFFF for r in recs] and args["who"] == [r.comm for r in recs]


def test_a_hit_the_host_takes_at_once_reaches_the_ring_handler_as_a_batch_of_one() -> None:
    te, got = sampled("p:rd ksys_read fd=%di:s32 count=%dx:u64")
    ring, ring_got = sampled("p:rd ksys_read fd=%di:s32 count=%dx:u64")
    assert ring.probe is not None and ring.probe.recorder is not None
    ring.probe.recorder(records())
    for rec in records():
        te._record(te.backend.make_regs(rec.values, rec.cpu), PROBE, None, None, task=(rec.pid, rec.comm))
    assert [len(b) for b in got] == [1] * len(records()) and te.nhit == len(records())
    assert [row for b in got for row in b] == list(ring_got[0])


def test_what_a_ring_handler_raises_leaves_the_run_counted() -> None:
    te, _ = sampled("p:rd ksys_read fd=%di:s32")

    def fails(batch: Samples) -> None:
        raise ValueError("mine")

    te.sample_cb = fails
    assert te.probe is not None and te.probe.recorder is not None
    with pytest.raises(ValueError):  # to the one handler runner, which counts it on the probe (qprobe.core.handlers)
        te.probe.recorder(records())
    assert te.nhit == len(records())


@pytest.mark.parametrize("definition", ["p:rd ksys_read n=+0(%di):u32", "r:rd ksys_read ret=$retval"])
def test_a_ring_handler_refuses_a_definition_the_guest_cannot_record(definition: str) -> None:
    with pytest.raises(InvalidProbe, match="a ring handler takes what an optimized probe records"):
        sampled(definition)
