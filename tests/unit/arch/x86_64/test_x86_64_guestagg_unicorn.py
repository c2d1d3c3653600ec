"""In-guest maps, run on a real x86 CPU model (unicorn).

The table the detour leaves must be exactly the Python model's map (each
hit's key words from ``part_words``, its count and its value's sum, min and
max), every register and flag must come back, and a hit that finds no slot is
counted as lost.
"""

from __future__ import annotations

import struct
from collections import Counter

import pytest

unicorn = pytest.importorskip("unicorn", reason="unicorn is not installed; it only cross-checks the arch layer")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from mapmodel_x86_64 import SPECS, TASKS, VALUES, Hit, model  # noqa: E402
from unicorn import x86_const as X  # noqa: E402

from qprobe.arch.inguest import KeyPart, KeySpec, MapSlot  # noqa: E402
from qprobe.arch.x86_64.detour import E_COMM, E_CPU_PID, ENTRY_SIZE, FRAME_REGS  # noqa: E402
from qprobe.arch.x86_64.guestagg import (  # noqa: E402
    MAX_PROBE,
    TABLE_ENTRIES,
    build_keyed_detour,
    parse_tables,
    part_words,
    slot_index,
    slot_words,
    table_size,
)
from qprobe.arch.x86_64.guestram import X86GuestRam  # noqa: E402
from qprobe.shell.render import log2_bucket  # noqa: E402

DETOUR, RESUME, PERCPU, TABLES, COUNTERS, STACK = 0x11000000, 0x12000000, 0x20000000, 0x40000000, 0x51000000, 0x60008000
TASK = 0x70000000
CPU_NUMBER, CURRENT, PID_OFF, COMM_OFF, CPU, NCPUS = 0x100, 0x108, 0x9A4, 0xB78, 1, 2
HITS, LOST = COUNTERS, COUNTERS + 8
NOP5 = bytes.fromhex("0f1f440000")
UC = {name: getattr(X, f"UC_X86_REG_{name.upper()}") for name in FRAME_REGS}
ARITH_FLAGS = st.sets(st.sampled_from([0x1, 0x4, 0x10, 0x40, 0x80, 0x800])).map(lambda s: 0x202 | sum(s))


def machine(spec: KeySpec) -> unicorn.Uc:
    uc = unicorn.Uc(unicorn.UC_ARCH_X86, unicorn.UC_MODE_64)
    for base in (DETOUR, RESUME, PERCPU, TABLES, COUNTERS, TASK):
        uc.mem_map(base, 0x100000)
    uc.mem_map(STACK - 0x8000, 0x10000)
    uc.mem_write(RESUME, b"\xf4")
    uc.msr_write(0xC0000101, PERCPU)  # GS base
    uc.mem_write(PERCPU + CPU_NUMBER, CPU.to_bytes(4, "little"))
    uc.mem_write(PERCPU + CURRENT, TASK.to_bytes(8, "little"))
    code, _ = build_keyed_detour(DETOUR, spec, TABLES, CPU_NUMBER, (CURRENT, PID_OFF, COMM_OFF), HITS, LOST, NOP5,
                                 RESUME)  # fmt: skip
    uc.mem_write(DETOUR, code)
    return uc


def hit(uc: unicorn.Uc, regs: dict[str, int], flags: int, pid: int = 1, comm: bytes = b"init") -> None:
    uc.mem_write(TASK + PID_OFF, (pid & 0xFFFFFFFF).to_bytes(4, "little"))
    uc.mem_write(TASK + COMM_OFF, comm[:16].ljust(16, b"\0"))
    for name, value in regs.items():
        uc.reg_write(UC[name], value)
    uc.reg_write(X.UC_X86_REG_RSP, STACK)
    uc.reg_write(X.UC_X86_REG_EFLAGS, flags)
    uc.emu_start(DETOUR, RESUME, count=10_000)
    assert uc.reg_read(X.UC_X86_REG_RIP) == RESUME and uc.reg_read(X.UC_X86_REG_RSP) == STACK
    assert uc.reg_read(X.UC_X86_REG_EFLAGS) & 0xFFF == flags
    assert {name: uc.reg_read(UC[name]) for name in FRAME_REGS} == regs


def table(uc: unicorn.Uc, spec: KeySpec, cpu: int = CPU) -> dict[tuple[int, ...], MapSlot]:
    size = table_size(spec)
    raw = bytes(uc.mem_read(TABLES + cpu * size, size))
    n = slot_words(spec) * 8
    keys = [raw[i * n : i * n + spec.words * 8] for i in range(TABLE_ENTRIES) if any(raw[i * n + spec.words * 8 :][:8])]
    assert len(keys) == len(set(keys)), "a key in two slots"
    return parse_tables(spec, raw)


@settings(max_examples=80, deadline=None)
@given(SPECS, st.lists(st.tuples(VALUES, VALUES, TASKS), min_size=1, max_size=12), ARITH_FLAGS)
def test_the_table_holds_the_model_s_map(spec: KeySpec, hits: list[tuple[int, int, tuple[int, bytes]]],
                                         flags: int) -> None:  # fmt: skip
    uc = machine(spec)
    done: list[Hit] = []
    for i, (a, b, (pid, comm)) in enumerate(hits):
        regs = {name: (a if (j + i) % 2 else b) for j, name in enumerate(FRAME_REGS)}
        hit(uc, regs, flags, pid, comm)
        done.append((regs, CPU, pid, comm))
    assert table(uc, spec) == model(spec, done)
    assert table(uc, spec, cpu=0) == {}  # another CPU's table is not touched
    assert struct.unpack("<2Q", uc.mem_read(HITS, 16)) == (len(hits), 0)


def test_the_histogram_key_is_bpftrace_s_bucket() -> None:
    for bits in (8, 16, 32, 64):
        for signed in (False, True):
            part = KeyPart("hist", "di", bits, signed)
            for v in (0, 1, 2, 3, 4, 100, (1 << bits) - 1, 1 << (bits - 1)):
                value = v - (1 << bits) if signed and v >> (bits - 1) else v
                assert part_words(part, v) == (log2_bucket(value),)


def test_a_hit_with_no_free_slot_within_reach_is_lost() -> None:
    spec = KeySpec((KeyPart("reg", "di"),))
    uc = machine(spec)
    key = 12345
    # Fill the MAX_PROBE slots from the key's hash on with other keys.
    first, n = slot_index((key,)), slot_words(spec) * 8
    for i in range(MAX_PROBE):
        slot = TABLES + CPU * table_size(spec) + ((first + i) % TABLE_ENTRIES) * n
        uc.mem_write(slot, struct.pack("<2Q", 10_000 + i, 1))
    regs = {name: 0 for name in FRAME_REGS} | {"rdi": key}
    hit(uc, regs, 0x202)
    assert (key,) not in table(uc, spec)
    assert struct.unpack("<2Q", uc.mem_read(HITS, 16)) == (1, 1)


def test_a_map_without_key_keeps_one_slot() -> None:
    spec = KeySpec((), KeyPart("reg", "si", 32, True))
    uc = machine(spec)
    for v in (5, -7, 3):
        hit(uc, {name: 0 for name in FRAME_REGS} | {"rsi": v & (2**64 - 1)}, 0x202)
    assert table(uc, spec) == {(): MapSlot(3, 1, -7, 5)}
    assert Counter(table(uc, spec, cpu=0)) == Counter()


def test_a_count_without_key_or_value_keeps_one_slot() -> None:
    # The shell's keyless count, folded in guest RAM.
    spec = KeySpec(())
    uc = machine(spec)
    for _ in range(4):
        hit(uc, {name: 0 for name in FRAME_REGS}, 0x202)
    assert table(uc, spec) == {(): MapSlot(4)}


def test_the_map_read_back_decodes_comm_and_a_negative_pid_as_a_record_does() -> None:
    """X86GuestRam.parse_guest_map gives a key's comm as text and its pid signed, as parse_ring_entries does: the
    detour's words for one hit (comm ``kworker/0:1``, pid -1, CPU 1) come back as those parts, and two CPUs'
    slots of one key as one."""
    spec = KeySpec((KeyPart("comm"), KeyPart("pid"), KeyPart("cpu")))
    uc = machine(spec)
    hit(uc, {name: 0 for name in FRAME_REGS}, 0x202, pid=-1, comm=b"kworker/0:1")
    raw = bytes(uc.mem_read(TABLES, table_size(spec) * NCPUS))
    assert X86GuestRam().parse_guest_map(spec, raw + raw) == {("kworker/0:1", -1, CPU): MapSlot(2)}
    record = bytearray(ENTRY_SIZE)
    record[E_CPU_PID : E_CPU_PID + 8] = struct.pack("<II", CPU, 0xFFFFFFFF)
    record[E_COMM : E_COMM + 16] = b"kworker/0:1".ljust(16, b"\0")
    (entry,) = X86GuestRam().parse_ring_entries(bytes(record))
    assert (entry.comm, entry.pid, entry.cpu) == ("kworker/0:1", -1, CPU)


@pytest.mark.parametrize("signed", [False, True])
def test_the_cpus_sums_wrap_at_64_bits_as_one_cpu_s_would(signed: bool) -> None:
    """Two CPUs' sums that pass 2**64 together: added as one CPU's adds, modulo 2**64, read as the value's type."""
    spec = KeySpec((), KeyPart("reg", "rax", 64, signed))
    big = (1 << 63) + 5  # each CPU's one hit
    table = bytes(table_size(spec))
    slot = struct.pack("<4Q", 1, big, big, big)  # count, sum, min, max in the no-key slot
    raw = slot + table[len(slot) :]
    (got,) = parse_tables(spec, raw + raw).values()
    want = (2 * big) & ((1 << 64) - 1)  # 10
    assert got.count == 2 and got.total == want
