"""The in-guest detours run on a real x86 CPU model (unicorn): the counting head and the record stub.

What the guest executes must leave every register and flag as it found
them, land in the detour's continue label with the stack pointer restored,
and write exactly the ring entry the host's drain expects.
"""

from __future__ import annotations

import struct

import pytest

unicorn = pytest.importorskip("unicorn", reason="unicorn is not installed; it only cross-checks the arch layer")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from unicorn import x86_const as X  # noqa: E402

from qprobe.arch.x86_64 import detour  # noqa: E402
from qprobe.arch.x86_64.detour import (  # noqa: E402
    DETOUR_HEAD,
    DRAIN_DOORBELL,
    E_COMM,
    E_CPU_PID,
    E_TASK,
    E_TSC,
    ENTRY_SIZE,
    FRAME_REGS,
    R_HEAD,
    R_LOSSY,
    R_TAIL,
    R_WAITS,
    RING_HEADER,
    RecordParams,
    build_count_detour,
    build_detour,
    build_record_stub,
)
from qprobe.arch.x86_64.ptregs import parse_pt_regs, parse_stub_frame  # noqa: E402

# Low addresses (unicorn cannot run in the upper half); they still fit the sign-extended disp32 forms.
STUB, DETOUR, RESUME = 0x10000000, 0x11000000, 0x12000000
PERCPU, TASK, RINGS, LOST, COUNTERS, STACK = 0x20000000, 0x30000000, 0x40000000, 0x50000000, 0x51000000, 0x60008000
CPU_NUMBER, CURRENT_TASK, PID_OFF, COMM_OFF = 0x100, 0x200, 0x980, 0xBB0
NCPUS, CPU, PID, PROBE_ID = 2, 1, 4242, 77
NOP5 = bytes.fromhex("0f1f440000")
UC = {name: getattr(X, f"UC_X86_REG_{name.upper()}") for name in FRAME_REGS}
FLAGS = 0x202 | 0x1 | 0x40 | 0x80 | 0x800  # IF, CF, ZF, SF, OF: all must come back


def machine() -> unicorn.Uc:
    uc = unicorn.Uc(unicorn.UC_ARCH_X86, unicorn.UC_MODE_64)
    for base in (STUB, DETOUR, RESUME, PERCPU, TASK, RINGS, LOST, COUNTERS):
        uc.mem_map(base, 0x100000)
    uc.mem_map(STACK - 0x8000, 0x10000)
    uc.mem_write(RESUME, b"\xf4")
    uc.msr_write(0xC0000101, PERCPU)  # GS base
    uc.mem_write(PERCPU + CPU_NUMBER, CPU.to_bytes(4, "little"))
    uc.mem_write(PERCPU + CURRENT_TASK, TASK.to_bytes(8, "little"))
    uc.mem_write(TASK + PID_OFF, PID.to_bytes(4, "little"))
    uc.mem_write(TASK + COMM_OFF, b"workload".ljust(16, b"\0"))
    return uc


def run(uc: unicorn.Uc, regs: dict[str, int], flags: int = FLAGS, count: int = 10_000) -> dict[str, int]:
    for name, value in regs.items():
        uc.reg_write(UC[name], value)
    uc.reg_write(X.UC_X86_REG_RSP, STACK)
    uc.reg_write(X.UC_X86_REG_EFLAGS, flags)
    uc.emu_start(DETOUR, RESUME, count=count)
    out = {name: uc.reg_read(UC[name]) for name in FRAME_REGS}
    assert uc.reg_read(X.UC_X86_REG_RIP) == RESUME
    assert uc.reg_read(X.UC_X86_REG_RSP) == STACK
    assert uc.reg_read(X.UC_X86_REG_EFLAGS) & 0xFFF == flags
    return out


RECORD_PORT = 0x504
RING_ENTRIES = 256  # not the default: the stub takes its rings' size from RecordParams
PARAMS = RecordParams(RINGS, RINGS + RING_HEADER * NCPUS, RING_ENTRIES, LOST, CPU_NUMBER, CURRENT_TASK, PID_OFF,
                      COMM_OFF, RECORD_PORT)  # fmt: skip
REGS = st.fixed_dictionaries({name: st.integers(0, 2**64 - 1) for name in FRAME_REGS})


@settings(max_examples=25, deadline=None)
@given(REGS)
def test_record_stub_writes_the_entry_the_host_reads_and_preserves_everything(regs: dict[str, int]) -> None:
    uc = machine()
    uc.mem_write(STUB, build_record_stub(PARAMS, STUB))
    uc.mem_write(DETOUR, build_detour(DETOUR, PROBE_ID, STUB, NOP5, RESUME))
    assert run(uc, regs) == regs
    header = RINGS + RING_HEADER * CPU
    assert struct.unpack("<Q", uc.mem_read(header + R_HEAD, 8))[0] == 1
    entry = bytes(uc.mem_read(RINGS + RING_HEADER * NCPUS + CPU * RING_ENTRIES * ENTRY_SIZE, ENTRY_SIZE))
    # The frame is a struct pt_regs: the registers, flags and stack pointer at the probe.
    pt = parse_pt_regs(entry)
    assert {name: pt[name] for name in FRAME_REGS} == regs
    assert pt["eflags"] & 0xFFF == FLAGS and pt["rsp"] == STACK
    values, ret, probe_id = parse_stub_frame(entry)
    assert values == {**regs, "eflags": pt["eflags"], "rsp": STACK}
    assert ret == DETOUR + DETOUR_HEAD and probe_id == PROBE_ID  # continue label, probe id
    cpu_pid, tsc, task = (struct.unpack_from("<Q", entry, off)[0] for off in (E_CPU_PID, E_TSC, E_TASK))
    assert cpu_pid == CPU | PID << 32 and task == TASK and tsc != 0
    assert entry[E_COMM : E_COMM + 8] == b"workload"
    assert struct.unpack("<Q", uc.mem_read(LOST + PROBE_ID * 8, 8))[0] == 0


def _u64(uc: unicorn.Uc, addr: int) -> int:
    return int(struct.unpack("<Q", uc.mem_read(addr, 8))[0])


def _doorbell(uc: unicorn.Uc, rung: list[tuple[int, int]], on_ring: object = None) -> None:
    """Record every ``out`` (port, byte); ``on_ring()`` runs after each, as the host's drain would."""

    def out(uc: unicorn.Uc, port: int, size: int, value: int, _data: object) -> None:
        rung.append((port, value & 0xFF))
        if callable(on_ring):
            on_ring()

    uc.hook_add(unicorn.UC_HOOK_INSN, out, None, 1, 0, X.UC_X86_INS_OUT)


def _full_ring() -> tuple[unicorn.Uc, int]:
    """A machine with the record stub and a detour to it, and CPU's ring header (its ring full: the host
    has consumed nothing)."""
    uc = machine()
    uc.mem_write(STUB, build_record_stub(PARAMS, STUB))
    uc.mem_write(DETOUR, build_detour(DETOUR, PROBE_ID, STUB, NOP5, RESUME))
    header = RINGS + RING_HEADER * CPU
    uc.mem_write(header + R_HEAD, RING_ENTRIES.to_bytes(8, "little"))
    return uc, header


def test_a_full_lossy_ring_counts_the_record_as_lost_and_changes_nothing_else() -> None:
    uc, header = _full_ring()
    uc.mem_write(header + R_LOSSY, (1).to_bytes(8, "little"))
    rung: list[tuple[int, int]] = []
    _doorbell(uc, rung)
    regs = {name: 0x1000 + i for i, name in enumerate(FRAME_REGS)}
    assert run(uc, regs) == regs
    assert _u64(uc, header + R_HEAD) == RING_ENTRIES and _u64(uc, header + R_WAITS) == 0 and not rung
    assert _u64(uc, LOST + PROBE_ID * 8) == 1


def test_a_full_ring_makes_the_record_wait_for_the_host_and_loses_nothing() -> None:
    """The record rings the doorbell once, spins until the host has moved the tail, then is written."""
    uc, header = _full_ring()
    rung: list[tuple[int, int]] = []
    # The host drains everything when the doorbell rings (its collector, woken by the byte).
    _doorbell(uc, rung, lambda: uc.mem_write(header + R_TAIL, RING_ENTRIES.to_bytes(8, "little")))
    regs = {name: 0x2000 + i for i, name in enumerate(FRAME_REGS)}
    assert run(uc, regs, count=100_000) == regs
    assert rung == [(RECORD_PORT, DRAIN_DOORBELL)]
    assert _u64(uc, header + R_HEAD) == RING_ENTRIES + 1 and _u64(uc, header + R_WAITS) == 1
    assert _u64(uc, LOST + PROBE_ID * 8) == 0
    entry = bytes(uc.mem_read(RINGS + RING_HEADER * NCPUS + CPU * RING_ENTRIES * ENTRY_SIZE, ENTRY_SIZE))
    values, _ret, probe_id = parse_stub_frame(entry)  # slot 256 % 256: the first, drained
    assert probe_id == PROBE_ID and {name: values[name] for name in FRAME_REGS} == regs


def test_a_record_whose_host_never_drains_is_lost_after_its_spins(monkeypatch: pytest.MonkeyPatch) -> None:
    """A guest whose qprobe is gone is slowed by SPIN_LIMIT pause loops a record, never hung."""
    monkeypatch.setattr(detour, "SPIN_LIMIT", 50)
    uc, header = _full_ring()
    rung: list[tuple[int, int]] = []
    _doorbell(uc, rung)
    regs = {name: 0x3000 + i for i, name in enumerate(FRAME_REGS)}
    assert run(uc, regs, count=100_000) == regs
    assert rung == [(RECORD_PORT, DRAIN_DOORBELL)] and _u64(uc, header + R_WAITS) == 1
    assert _u64(uc, header + R_HEAD) == RING_ENTRIES and _u64(uc, LOST + PROBE_ID * 8) == 1


# Every combination of the arithmetic flags (CF PF AF ZF SF OF), with IF and the reserved bit set.
ARITH_FLAGS = st.sets(st.sampled_from([0x1, 0x4, 0x10, 0x40, 0x80, 0x800])).map(lambda s: 0x202 | sum(s))


@settings(max_examples=60, deadline=None)
@given(REGS, st.integers(1, 5), ARITH_FLAGS, st.integers(0, 2**64 - 1))
def test_count_detour_counts_and_preserves_everything(regs: dict[str, int], hits: int, flags: int, start: int) -> None:
    uc = machine()
    counter = COUNTERS + PROBE_ID * 8
    uc.mem_write(counter, start.to_bytes(8, "little"))  # an increment that overflows or wraps changes nothing else
    uc.mem_write(DETOUR, build_count_detour(DETOUR, counter, NOP5, RESUME))
    for _ in range(hits):
        assert run(uc, regs, flags) == regs
    assert struct.unpack("<Q", uc.mem_read(counter, 8))[0] == (start + hits) % 2**64


# -- a filter compiled into the record detour ---------------------------------------------------
from qprobe.arch.x86_64.guestfilter import GPRS, build_filtered_detour  # noqa: E402
from qprobe.fetch.filter import And, GuestReg, Not, Or, Pred, evaluator  # noqa: E402


def evaluate(node: object, regs: dict[str, int]) -> bool:
    """What the compiled code must decide: the filter's meaning, in Python (``regs`` are 64-bit values)."""
    match node:
        case Pred(_, op, int() as const, GuestReg() as at):
            v = typed(regs[at.reg], at)
            return {"==": v == const, "!=": v != const, "<": v < const, "<=": v <= const, ">": v > const,
                    ">=": v >= const, "&": bool(v & const)}[op]  # fmt: skip
        case And(parts):
            return all(evaluate(p, regs) for p in parts)
        case Or(parts):
            return any(evaluate(p, regs) for p in parts)
        case Not(inner):
            return not evaluate(inner, regs)
    raise TypeError(f"not a filter node: {node!r}")


def typed(value: int, at: GuestReg) -> int:
    """A 64-bit register's value as the field bound to it reads it."""
    v = value & ((1 << at.bits) - 1)
    return v - (1 << at.bits) if at.signed and v >> (at.bits - 1) else v


def _pred(draw: st.DrawFn) -> Pred:
    bits, signed = draw(st.sampled_from([(64, False), (64, True), (32, False), (32, True)]))
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    const = draw(st.one_of(st.integers(lo, hi), st.sampled_from([lo, hi, 0, 1, -1 if signed else 2])))
    op = draw(st.sampled_from(["==", "!=", "<", "<=", ">", ">=", "&"]))
    at = GuestReg(draw(st.sampled_from(GPRS)), bits, signed)
    # A field per register and type, so that a record can hold what every leaf reads.
    return Pred(f"{at.reg}_{'s' if signed else 'u'}{bits}", op, const, at)


@st.composite
def trees(draw: st.DrawFn, depth: int = 2) -> object:
    if depth == 0 or draw(st.booleans()):
        return _pred(draw)
    kind = draw(st.sampled_from(["and", "or", "not"]))
    if kind == "not":
        return Not(draw(trees(depth - 1)))
    parts = tuple(draw(st.lists(trees(depth - 1), min_size=2, max_size=3)))
    return And(parts) if kind == "and" else Or(parts)


def leaves(n: object) -> list[Pred]:
    if isinstance(n, Pred):
        return [n]
    return [p for child in getattr(n, "parts", ()) or ([n.inner] if isinstance(n, Not) else []) for p in leaves(child)]


@st.composite
def regs_near(draw: st.DrawFn, tree: object) -> dict[str, int]:
    """Register values, often equal to (or next to) the tree's constants so that every branch is taken."""
    consts = [p.const for p in leaves(tree)]
    value = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from(consts).flatmap(
        lambda c: st.sampled_from([c - 1, c, c + 1]).map(lambda v: v % 2**64)))  # fmt: skip
    return {name: draw(value) for name in FRAME_REGS}


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_filtered_detour_records_exactly_what_the_filter_accepts(data: st.DataObject) -> None:
    tree = data.draw(trees())
    regs = data.draw(regs_near(tree))
    flags = data.draw(ARITH_FLAGS)
    uc = machine()
    filtered = COUNTERS + PROBE_ID * 8
    uc.mem_write(STUB, build_record_stub(PARAMS, STUB))
    code, relocated_at = build_filtered_detour(DETOUR, tree, PROBE_ID, STUB, filtered, NOP5, RESUME)
    uc.mem_write(DETOUR, code)
    assert run(uc, regs, flags) == regs
    recorded = struct.unpack("<Q", uc.mem_read(RINGS + RING_HEADER * CPU + R_HEAD, 8))[0]
    rejected = struct.unpack("<Q", uc.mem_read(filtered, 8))[0]
    by_pt_name = {g: regs["r" + g if not g.startswith("r") else g] for g in GPRS}
    expected = evaluate(tree, by_pt_name)
    assert (recorded, rejected) == ((1, 0) if expected else (0, 1))
    # The host's evaluator of the same tree decides the same, given the values the leaves' registers hold.
    record = {p.field: typed(by_pt_name[p.at.reg], p.at) for p in leaves(tree) if p.at is not None}
    assert evaluator(tree)(record) == expected
    if expected:  # the stub returns to the nop just before the relocated code
        entry = bytes(uc.mem_read(RINGS + RING_HEADER * NCPUS + CPU * RING_ENTRIES * ENTRY_SIZE, ENTRY_SIZE))
        assert parse_stub_frame(entry)[1] == DETOUR + relocated_at - 1


@pytest.mark.parametrize("leaf", [Pred("fd", "==", 3), Pred("comm", "==", "sh", GuestReg("di", 64, False))])
def test_a_leaf_the_guest_cannot_test_is_refused(leaf: Pred) -> None:
    """An unbound leaf, or a string compare, has no code: the filter must stay on the host."""
    tree = And((Pred("n", "==", 1, GuestReg("si", 64, False)), leaf))
    with pytest.raises(TypeError, match="not a filter node the guest can test"):
        build_filtered_detour(DETOUR, tree, PROBE_ID, STUB, COUNTERS, NOP5, RESUME)


# -- the mailbox stub: the host reads a pt_regs and says where the vCPU goes on -------------------
from qprobe.arch.x86_64.detour import MAILBOX_SIZE, StubParams, build_stub  # noqa: E402
from qprobe.arch.x86_64.guestram import X86GuestRam  # noqa: E402

MAILBOXES, THIS_CPU_OFF, PORT = 0x52000000, 0x300, 0xE9
SKIPPED = 0x13000000  # where a handler that changed ip sends the vCPU


@pytest.mark.parametrize("skip", [False, True], ids=["continue", "skip the function"])
def test_mailbox_stub_hands_the_host_the_probed_context_and_resumes_where_it_says(skip: bool) -> None:
    uc = machine()
    uc.mem_map(MAILBOXES, 0x100000)
    uc.mem_map(SKIPPED, 0x1000)
    uc.mem_write(SKIPPED, b"\xf4")
    uc.mem_write(PERCPU + THIS_CPU_OFF, PERCPU.to_bytes(8, "little"))
    params = StubParams(MAILBOXES, LOST, CPU_NUMBER, THIS_CPU_OFF, CURRENT_TASK, PORT)
    uc.mem_write(STUB, build_stub(params, STUB))
    uc.mem_write(DETOUR, build_detour(DETOUR, PROBE_ID, STUB, NOP5, RESUME))
    arch, box = X86GuestRam(), MAILBOXES + CPU * MAILBOX_SIZE
    seen = []

    def doorbell(uc: unicorn.Uc, port: int, size: int, value: int, data: object) -> None:
        """The host's side, as qprobe.core.doorbell does it: read the request, answer, publish DONE."""
        req = arch.read_mailbox(lambda off, n: bytes(uc.mem_read(box + off, n)))
        assert req is not None and port == PORT and value == CPU
        seen.append(req)
        final_ip = SKIPPED if skip else req.continue_addr
        for off, data_ in arch.mailbox_answer({"rax": 0x5A5A, "eflags": FLAGS ^ 0x1}, final_ip, req.final_sp):
            uc.mem_write(box + off, data_)

    uc.hook_add(unicorn.UC_HOOK_INSN, doorbell, None, 1, 0, X.UC_X86_INS_OUT)
    regs = {name: 0x3000 + i for i, name in enumerate(FRAME_REGS)}
    for name, value in regs.items():
        uc.reg_write(UC[name], value)
    uc.reg_write(X.UC_X86_REG_RSP, STACK)
    uc.reg_write(X.UC_X86_REG_EFLAGS, FLAGS)
    uc.emu_start(DETOUR, SKIPPED if skip else RESUME, count=10_000)
    (req,) = seen
    assert req.probe_id == PROBE_ID and req.continue_addr == DETOUR + DETOUR_HEAD and req.final_sp == STACK
    assert {name: req.values[name] for name in FRAME_REGS} == regs and req.values["rsp"] == STACK
    assert req.values["eflags"] & 0xFFF == FLAGS and req.values["gs_base"] == PERCPU
    assert uc.reg_read(X.UC_X86_REG_RIP) == (SKIPPED if skip else RESUME) and uc.reg_read(X.UC_X86_REG_RSP) == STACK
    assert {name: uc.reg_read(UC[name]) for name in FRAME_REGS} == {**regs, "rax": 0x5A5A}
    assert uc.reg_read(X.UC_X86_REG_EFLAGS) & 0xFFF == FLAGS ^ 0x1
    assert struct.unpack("<2Q", uc.mem_read(box, 16)) == (0, 0)  # idle and not busy again
