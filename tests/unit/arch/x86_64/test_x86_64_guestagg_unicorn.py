"""Keyed counts computed in the guest, run on a real x86 CPU model (unicorn).

The table the detour leaves must be exactly the Python model's counts
(``key_value`` of each hit's register), every register and flag must come
back, and a hit that finds no slot is counted as lost.
"""

from __future__ import annotations

import struct
from collections import Counter

import pytest

unicorn = pytest.importorskip("unicorn", reason="unicorn is not installed; it only cross-checks the arch layer")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from unicorn import x86_const as X  # noqa: E402

from qprobe.arch.x86_64.detour import FRAME_REGS  # noqa: E402
from qprobe.arch.x86_64.guestagg import (  # noqa: E402
    MAX_PROBE,
    SLOT_SIZE,
    TABLE_ENTRIES,
    TABLE_SIZE,
    KeySpec,
    build_keyed_detour,
    key_value,
    slot_index,
)
from qprobe.arch.x86_64.guestfilter import GPRS  # noqa: E402
from qprobe.shell.render import log2_bucket  # noqa: E402

DETOUR, RESUME, PERCPU, TABLES, COUNTERS, STACK = 0x11000000, 0x12000000, 0x20000000, 0x40000000, 0x51000000, 0x60008000
CPU_NUMBER, CPU, NCPUS = 0x100, 1, 2
HITS, LOST = COUNTERS, COUNTERS + 8
NOP5 = bytes.fromhex("0f1f440000")
UC = {name: getattr(X, f"UC_X86_REG_{name.upper()}") for name in FRAME_REGS}
ARITH_FLAGS = st.sets(st.sampled_from([0x1, 0x4, 0x10, 0x40, 0x80, 0x800])).map(lambda s: 0x202 | sum(s))


def machine(spec: KeySpec) -> unicorn.Uc:
    uc = unicorn.Uc(unicorn.UC_ARCH_X86, unicorn.UC_MODE_64)
    for base in (DETOUR, RESUME, PERCPU, TABLES, COUNTERS):
        uc.mem_map(base, 0x100000)
    uc.mem_map(STACK - 0x8000, 0x10000)
    uc.mem_write(RESUME, b"\xf4")
    uc.msr_write(0xC0000101, PERCPU)  # GS base
    uc.mem_write(PERCPU + CPU_NUMBER, CPU.to_bytes(4, "little"))
    code, _ = build_keyed_detour(DETOUR, spec, TABLES, CPU_NUMBER, HITS, LOST, NOP5, RESUME)
    uc.mem_write(DETOUR, code)
    return uc


def hit(uc: unicorn.Uc, regs: dict[str, int], flags: int) -> None:
    for name, value in regs.items():
        uc.reg_write(UC[name], value)
    uc.reg_write(X.UC_X86_REG_RSP, STACK)
    uc.reg_write(X.UC_X86_REG_EFLAGS, flags)
    uc.emu_start(DETOUR, RESUME, count=10_000)
    assert uc.reg_read(X.UC_X86_REG_RIP) == RESUME and uc.reg_read(X.UC_X86_REG_RSP) == STACK
    assert uc.reg_read(X.UC_X86_REG_EFLAGS) & 0xFFF == flags
    assert {name: uc.reg_read(UC[name]) for name in FRAME_REGS} == regs


def table(uc: unicorn.Uc, cpu: int = CPU) -> Counter[int]:
    raw = bytes(uc.mem_read(TABLES + cpu * TABLE_SIZE, TABLE_SIZE))
    out: Counter[int] = Counter()
    for i in range(TABLE_ENTRIES):
        key, count = struct.unpack_from("<2Q", raw, i * SLOT_SIZE)
        if count:
            assert key not in out, "a key in two slots"
            out[key] = count
    return out


SPECS = st.builds(KeySpec, st.sampled_from(GPRS), st.sampled_from([8, 16, 32, 64]), st.booleans(), st.booleans())
VALUES = st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 40), st.integers(2**64 - 40, 2**64 - 1),
                   st.sampled_from([0, 1, 2, 3, 0x80, 0xFF, 0x8000, 0x7FFFFFFF, 0x80000000, 2**63]))  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(SPECS, st.lists(VALUES, min_size=1, max_size=12), ARITH_FLAGS, st.integers(0, 2**64 - 1))
def test_the_table_holds_the_model_s_counts(spec: KeySpec, values: list[int], flags: int, other: int) -> None:
    uc = machine(spec)
    reg = "r" + spec.reg if not spec.reg.startswith("r") else spec.reg
    for v in values:
        hit(uc, {name: (v if name == reg else other) for name in FRAME_REGS}, flags)
    assert table(uc) == Counter(key_value(spec, v) for v in values)
    assert table(uc, cpu=0) == Counter()  # another CPU's table is not touched
    assert struct.unpack("<2Q", uc.mem_read(HITS, 16)) == (len(values), 0)


def test_the_histogram_key_is_bpftrace_s_bucket() -> None:
    for bits in (8, 16, 32, 64):
        for signed in (False, True):
            spec = KeySpec("di", bits, signed, hist=True)
            for v in (0, 1, 2, 3, 4, 100, (1 << bits) - 1, 1 << (bits - 1)):
                typed = v - (1 << bits) if signed and v >> (bits - 1) else v
                assert key_value(spec, v) == log2_bucket(typed)


def test_a_hit_with_no_free_slot_within_reach_is_lost() -> None:
    spec = KeySpec("di", 64, False, hist=False)
    uc = machine(spec)
    key = 12345
    # Fill the MAX_PROBE slots from the key's hash on with other keys.
    first = slot_index(key)
    for n in range(MAX_PROBE):
        slot = TABLES + CPU * TABLE_SIZE + ((first + n) % TABLE_ENTRIES) * SLOT_SIZE
        uc.mem_write(slot, struct.pack("<2Q", 10_000 + n, 1))
    regs = {name: 0 for name in FRAME_REGS} | {"rdi": key}
    hit(uc, regs, 0x202)
    assert key not in table(uc)
    assert struct.unpack("<2Q", uc.mem_read(HITS, 16)) == (1, 1)
