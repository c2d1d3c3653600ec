"""The keyed uprobe handler (X86GuestCall.build_keyed_handler), run on unicorn at kernel addresses.

The kernel calls it as a ``uprobe_consumer``'s handler(uc, regs), ``regs`` the probed user task's
``struct pt_regs``, with the CPU's own registers the kernel's, not the user's.  The tables it leaves must be
the host model's map of the pt_regs' values (each key's count, sum, min and max), each hit counted, a hit
that finds no slot counted as lost; it must return 0 as a C function does (callee-saved registers and the
stack as they were), with the flags' IF as it found it, and leave the user's registers alone.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import pytest

unicorn = pytest.importorskip("unicorn", reason="unicorn is not installed; it only cross-checks the arch layer")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from kernelcpu_x86_64 import CALLEE_SAVED, CALLER_SAVED, KernelCpu  # noqa: E402
from mapmodel_x86_64 import SPECS, TASKS, VALUES, Hit, model  # noqa: E402
from unicorn import x86_const as X  # noqa: E402

from qprobe.arch.inguest import KeyPart, KeySpec, MapSlot  # noqa: E402
from qprobe.arch.x86_64.guestagg import (  # noqa: E402
    COMM_LEN,
    MAX_PROBE,
    TABLE_ENTRIES,
    decode_key,
    parse_tables,
    slot_index,
    slot_words,
    table_size,
)
from qprobe.arch.x86_64.guestcall import X86GuestCall  # noqa: E402
from qprobe.arch.x86_64.ptregs import PT_GPRS, PT_REGS_ORDER, PT_REGS_SIZE, X86_EFLAGS_IF  # noqa: E402

TEXT = 0xFFFF_FFFF_8100_0000
HANDLER, RESUME = TEXT, TEXT + 0x1000  # RESUME: the kernel's call site (hlt)
COUNTERS = 0xFFFF_FFFF_8200_0000
HITS, LOST = COUNTERS, COUNTERS + 8
TABLES, TABLES_SIZE = 0xFFFF_FFFF_A000_0000, 0x40000  # the handler's absolute disp32s: the top 2 GiB
PERCPU, CPU_NUMBER, CURRENT = 0xFFFF_8880_1F00_0000, 0x1F0A4, 0x22D80  # GS base; per-CPU offsets
TASK, PID_OFF, COMM_OFF = 0xFFFF_8880_0420_0000, 0x9A4, 0xB78  # current; offsetof(task_struct, pid / comm)
STACK = 0xFFFF_C900_0001_0000  # the top of the task's kernel stack: its user pt_regs just below
PT_REGS = STACK - PT_REGS_SIZE
SP = PT_REGS - 0x100  # the handler's stack pointer at its entry: the return address
CONSUMER = 0xFFFF_8880_0500_0040  # the uprobe_consumer (rdi): the handler does not read it
NCPUS = 2
U64 = (1 << 64) - 1
WORD = st.integers(0, U64)
# guest_key's terms: pt_regs names, an argument's size in bits and signedness; a hist() its last part.
CASES = {
    "count and sum, no key": KeySpec((), KeyPart("reg", "di", 64, False)),
    "by comm": KeySpec((KeyPart("comm"),)),
    "by pid": KeySpec((KeyPart("pid"),)),
    "by cpu": KeySpec((KeyPart("cpu"),)),
    "by an s32 in si": KeySpec((KeyPart("reg", "si", 32, True),)),
    "hist of an s64": KeySpec((KeyPart("hist", "dx", 64, True),)),
    "hist of a u64 by comm": KeySpec((KeyPart("comm"), KeyPart("hist", "r8", 64, False))),
    "by pid and a u16 of an s64": KeySpec((KeyPart("pid"), KeyPart("reg", "cx", 16, False)),
                                          KeyPart("reg", "r9", 64, True)),
    "by callee-saved registers of a u32": KeySpec((KeyPart("reg", "bx"), KeyPart("reg", "r15", 8, True)),
                                                  KeyPart("reg", "ax", 32, False)),
}  # fmt: skip
USER = (0, 1, 5, -7 & U64, 1 << 63, 0xFFFF_FFFF, 0x8000_0001, 5, 0x1_0000_0005, U64)
KERNEL_REGS = CALLER_SAVED + CALLEE_SAVED
KERNEL = tuple(0x5A5A_0000_0000_0000 + 0x1111 * j for j in range(len(KERNEL_REGS)))  # the CPU's, at the call
USER_TASKS = ((1234, b"workload"), (1, b"init"), (-1, b"kworker/0:1H-kblockd"), (1234, b"workload"))


def machine(spec: KeySpec) -> KernelCpu:
    maps = ((TEXT, 0x2000), (COUNTERS, 0x1000), (TABLES, TABLES_SIZE), (PERCPU, 0x30000), (TASK, 0x2000),
            (STACK - 0x4000, 0x4000))  # fmt: skip
    cpu = KernelCpu(maps, PERCPU)
    assert table_size(spec) * NCPUS <= TABLES_SIZE
    cpu.write(
        HANDLER,
        X86GuestCall().build_keyed_handler(HANDLER, spec, TABLES, CPU_NUMBER, (CURRENT, PID_OFF, COMM_OFF), HITS, LOST),
    )
    cpu.write(RESUME, b"\xf4")
    cpu.write(PERCPU + CURRENT, TASK.to_bytes(8, "little"))
    at = cpu.phys(TABLES)
    cpu.uc.hook_add(unicorn.UC_HOOK_MEM_WRITE, interrupts_off, begin=at, end=at + TABLES_SIZE - 1)
    return cpu


def interrupts_off(uc: Any, access: int, address: int, size: int, value: int, data: Any) -> None:
    """A write to a table: the CPU must not take an interrupt mid-update (its table is its own, without atomics)."""
    assert not uc.reg_read(X.UC_X86_REG_EFLAGS) & X86_EFLAGS_IF, "a table written with interrupts on"


def hit(cpu: KernelCpu, user: dict[str, int], on: int, pid: int, comm: bytes, flags: int = 0x246,
        kernel: Sequence[int] = KERNEL) -> None:  # fmt: skip
    """One hit of the task ``pid``/``comm`` on CPU ``on``, the user's registers ``user`` in its pt_regs, the CPU's
    own registers ``kernel``; the handler must return 0 with the kernel's callee-saved registers, stack and IF."""
    cpu.write(PERCPU + CPU_NUMBER, on.to_bytes(4, "little") + b"\xff" * 4)  # an int: the rest is not its
    cpu.write(TASK + PID_OFF, (pid & 0xFFFF_FFFF).to_bytes(4, "little"))
    cpu.write(TASK + COMM_OFF, comm[: COMM_LEN - 1].ljust(COMM_LEN, b"\0"))
    frame = struct.pack(f"<{len(PT_REGS_ORDER)}Q", *(user.get(name, 0) for name in PT_REGS_ORDER))
    cpu.write(PT_REGS, frame)
    before = dict(zip(KERNEL_REGS, kernel, strict=True)) | {"rdi": CONSUMER, "rsi": PT_REGS}
    for name, value in before.items():
        cpu.reg(name, value)
    cpu.reg("eflags", flags)
    cpu.write(SP, RESUME.to_bytes(8, "little"))
    cpu.call(HANDLER, SP, RESUME)
    assert cpu.reg("rax") == 0  # 0: the breakpoint stays (UPROBE_HANDLER_REMOVE is 1)
    assert cpu.reg("rsp") == SP + 8
    assert cpu.regs(CALLEE_SAVED) == {name: before[name] for name in CALLEE_SAVED}
    assert cpu.reg("eflags") & X86_EFLAGS_IF == flags & X86_EFLAGS_IF
    assert cpu.read(PT_REGS, PT_REGS_SIZE) == frame  # the user's registers are not the handler's to change


def tables(cpu: KernelCpu, spec: KeySpec) -> dict[tuple[int, ...], MapSlot]:
    return parse_tables(spec, cpu.read(TABLES, table_size(spec) * NCPUS))


def counters(cpu: KernelCpu) -> tuple[int, int]:
    return cpu.word(HITS), cpu.word(LOST)


def user_regs(i: int) -> dict[str, int]:
    """The user's general registers at hit ``i``: each its own of USER, a key's register repeating now and then."""
    return {name: USER[(3 * i + j) % len(USER)] for j, name in enumerate(PT_GPRS)}


@pytest.mark.parametrize("name", CASES)
def test_the_tables_hold_the_model_s_map_of_the_pt_regs(name: str) -> None:
    spec = CASES[name]
    cpu = machine(spec)
    done: list[Hit] = []
    for i in range(12):
        user, on, (pid, comm) = user_regs(i), i % NCPUS, USER_TASKS[i % len(USER_TASKS)]
        hit(cpu, user, on, pid, comm, 0x246 if i % 3 else 0x46)  # IF on, as the kernel calls it, and off: as found
        done.append((user, on, pid, comm[: COMM_LEN - 1]))
    assert tables(cpu, spec) == model(spec, done)
    assert counters(cpu) == (12, 0)


def test_a_key_decodes_to_the_task_and_the_registers_of_the_hit() -> None:
    spec = KeySpec((KeyPart("comm"), KeyPart("pid"), KeyPart("cpu"), KeyPart("reg", "si", 32, True)))
    cpu = machine(spec)
    hit(cpu, {"rsi": 0xDEAD_0000_FFFF_FFF9}, 1, -1, b"kworker/0:1")
    (words,) = tables(cpu, spec)
    assert decode_key(spec, words) == ("kworker/0:1", -1, 1, (-7) & U64)  # a reg part: its typed 64-bit word


@settings(max_examples=40, deadline=None, database=None)
@given(spec=SPECS, hits=st.lists(st.tuples(st.lists(VALUES, min_size=len(PT_GPRS), max_size=len(PT_GPRS)), TASKS),
                                 min_size=1, max_size=8),
       kernel=st.lists(WORD, min_size=len(KERNEL), max_size=len(KERNEL)))  # fmt: skip
def test_any_map_folds_any_user_registers_as_the_model_says(
    spec: KeySpec, hits: list[tuple[list[int], tuple[int, bytes]]], kernel: list[int]
) -> None:
    cpu = machine(spec)
    done: list[Hit] = []
    for i, (words, (pid, comm)) in enumerate(hits):
        user = dict(zip(PT_GPRS, words, strict=True))
        hit(cpu, user, i % NCPUS, pid, comm, 0x202, kernel)
        done.append((user, i % NCPUS, pid, comm))
    assert tables(cpu, spec) == model(spec, done)
    assert counters(cpu) == (len(hits), 0)


def test_a_hit_with_no_free_slot_within_reach_is_lost() -> None:
    spec = KeySpec((KeyPart("reg", "di"),))
    n, on = slot_words(spec) * 8, 1
    # A key whose slots to try wrap past the table's end.
    key = next(k for k in range(1 << 20) if slot_index((k,)) > TABLE_ENTRIES - MAX_PROBE // 2)
    first = slot_index((key,))
    cpu = machine(spec)
    mine = TABLES + on * table_size(spec)
    for i in range(MAX_PROBE - 1):  # all but the last slot in reach taken by other keys
        cpu.write(mine + ((first + i) % TABLE_ENTRIES) * n, struct.pack("<2Q", 1 << 40 | i, 1))
    others = tables(cpu, spec)
    hit(cpu, {"rdi": key}, on, 1, b"init")
    assert tables(cpu, spec) == others | {(key,): MapSlot(1)}  # in the last slot, past the table's end
    assert counters(cpu) == (1, 0)
    last = (first + MAX_PROBE - 1) % TABLE_ENTRIES
    cpu.write(mine + last * n, struct.pack("<2Q", 1 << 41, 1))  # now another key's
    before = tables(cpu, spec)
    hit(cpu, {"rdi": key}, on, 1, b"init")
    assert tables(cpu, spec) == before
    assert counters(cpu) == (2, 1)
