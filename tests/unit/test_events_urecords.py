"""Uprobe records made hits in bulk (UprobeTraceEvent's recorder): the same hits, line for line, as one record at
a time through the stop path's ``_record``, for entries (each record's own user ip) and returns (the return
address and the probed function the ret_handler had)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from events_fakes import MEM, Clock

from qprobe.arch.x86_64.arch import X86_64
from qprobe.arch.x86_64.ptregs import PT_REGS_ORDER, X86_EFLAGS_IF
from qprobe.core.kprobe import GuestRecord
from qprobe.core.regs import PtRegs
from qprobe.events import EventHit
from qprobe.events.lines import InOrderLines
from qprobe.events.samples import Samples
from qprobe.events.timeline import Timeline
from qprobe.events.uprobe import UprobeTraceEvent
from qprobe.fetch import UprobeEvent, parse_uprobe_event

ARCH = X86_64()
PLACES = [(0x401136, 0x401100), (0x55D0_0000_1A50, 0x55D0_0000_1A00), (0x7F12_3456_1A50, 0x7F12_3456_1A00)]


class Backend:
    records_in_guest = True

    def record_regs(self, values: dict[str, int], cpu: int) -> PtRegs:
        return PtRegs(dict(values), f"1.{cpu + 1}", cpu, MEM, layout=ARCH.registers)  # type: ignore[arg-type]


def event(definition: str, limit: int | None) -> UprobeTraceEvent:
    host = SimpleNamespace(arch=ARCH, timeline=Timeline(), mem=MEM, clock=Clock(), uprobe_backend=Backend(),
                           kernel=SimpleNamespace(event_length_limit=lambda: limit))  # fmt: skip
    ev = parse_uprobe_event(definition, file_check=lambda path: "regular")
    assert isinstance(ev, UprobeEvent)
    te = UprobeTraceEvent(host, ev)  # type: ignore[arg-type]
    te.make_probe()
    assert te.probe is not None and te.probe.in_guest and te.probe.recorder is not None
    return te


def records() -> list[GuestRecord]:
    """Records as RecordRings hands on a sink's: the user pt_regs (its ip where the hit was), the cycle counter,
    and a return's function; runs of one place and places changing within the run, as processes map the file."""
    out = []
    for n, place in enumerate([0, 0, 1, 2, 2, 0]):
        ip, func = PLACES[place]
        word = [0, 2**64 - 3, 0x1_2345_6789_ABCD, 0x80, 7, 2**63][n]
        values = {name: (word + i) % 2**64 for i, name in enumerate(PT_REGS_ORDER)}
        values.update(eflags=X86_EFLAGS_IF if n % 2 else 0x2, rip=ip, cycles=1000 * n + 7)
        out.append(GuestRecord(values, n % 2, 100 + n, ["uprog", "sh", "uprog-static"][n % 3], 0xFFFF8880, 0.0, func))
    return out


DEFINITIONS = [
    "p:uq /bin/uprog:0x1a50 a=%di:s64 b=%si:u32",
    "p:uq /bin/uprog:0x1a50 a=%di b=%si:x16 c=%r15:s8 d=%ax sp=%sp ip=%ip",
    "p:uq /bin/uprog:0x1a50 a=%di:s64 c=$comm k=\\5:s8",
    "p:uq /bin/uprog:0x1a50",
    "r:uqr /bin/uprog:0x1a50 ret=$retval:s64",
    "r:uqr /bin/uprog:0x1a50 ret=$retval:x32 c=$comm sp=%sp",
]


def one_at_a_time(te: UprobeTraceEvent) -> None:
    """The records through the stop path's ``_record``, as the hits it would have made."""
    returns = te.udef.is_return
    for rec in records():
        regs = te.backend.record_regs(rec.values, rec.cpu)
        func, retval = (rec.func, regs.return_value()) if returns else (None, None)
        te._record(regs, regs.ip, func, retval, (rec.pid, rec.comm))


@pytest.mark.parametrize("limit", [None, 4056])
@pytest.mark.parametrize("definition", DEFINITIONS)
def test_a_run_of_records_gives_the_hits_one_record_at_a_time_gives(definition: str, limit: int | None) -> None:
    bulk, single = event(definition, limit), event(definition, limit)
    got: list[EventHit] = []
    expected: list[EventHit] = []
    bulk.callback, single.callback = got.append, expected.append
    assert bulk.probe is not None and bulk.probe.recorder is not None
    bulk.probe.recorder(records())
    one_at_a_time(single)
    assert [h.line() for h in got] == [h.line() for h in expected] and len(got) == len(records())
    assert got == expected  # every field: arguments, address, function, times, irqs
    assert bulk.nhit == single.nhit == len(expected)


@pytest.mark.parametrize("definition", DEFINITIONS)
def test_a_printer_s_lines_are_byte_for_byte_the_lines_of_one_hit_at_a_time(definition: str) -> None:
    """``qprobe trace``'s printer takes a run in bulk, a stretch of one place a LineRun; its text is each hit's
    ``EventHit.line``, in the same order."""
    bulk, single = event(definition, None), event(definition, None)
    out: list[str] = []
    bulk.callback = InOrderLines(
        lambda hit: out.append(hit.line() + "\n"), lambda run, a, b: out.append(run.text(a, b)[1])
    )
    assert bulk.probe is not None and bulk.probe.recorder is not None
    bulk.probe.recorder(records())
    one_at_a_time(single)
    bulk.host.timeline.flush()
    single.host.timeline.flush()
    assert "".join(out) == "".join(h.line() + "\n" for h in single.hits)
    assert bulk.nhit == single.nhit == len(records()) and not bulk.hits


def test_a_return_line_names_the_return_address_and_the_probed_function() -> None:
    te = event(DEFINITIONS[4], None)
    got: list[EventHit] = []
    te.callback = got.append
    assert te.probe is not None and te.probe.recorder is not None
    te.probe.recorder(records()[:1])
    rax = records()[0].values["rax"]
    assert rax < 2**63 and got[0].body == f"({PLACES[0][0]:#x} <- {PLACES[0][1]:#x}) ret={rax}"


@pytest.mark.parametrize("definition", DEFINITIONS)
def test_a_ring_handler_s_columns_are_each_hit_s_values_as_the_stop_path_evaluates_them(definition: str) -> None:
    te = event(definition, None)
    batches: list[Samples] = []
    te.sample_cb = batches.append
    assert te.probe is not None and te.probe.recorder is not None
    te.probe.recorder(records())
    (batch,) = batches
    expected, returns = [], te.udef.is_return
    for rec in records():  # each record's values through the hit's own context, as the stop path makes it
        regs = te.backend.record_regs(rec.values, rec.cpu)
        func, retval = (rec.func, regs.return_value()) if returns else (None, None)
        expected.append(te.udef.evaluate(te._context(regs, retval, rec.comm, regs.ip, func, None)))
    assert batch.args == {a.name: [row[i] for row in expected] for i, a in enumerate(te.udef.args)}
    assert batch.ts == [Clock().hit_time(te.backend.record_regs(r.values, r.cpu), recorded=True)[0] for r in records()]
    fields = ("cpu", "pid", "comm")
    assert [getattr(batch, f) for f in fields] == [[getattr(r, f) for r in records()] for f in fields]
    assert te.nhit == len(records())
