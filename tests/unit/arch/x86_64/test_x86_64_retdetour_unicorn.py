"""Return probes with instances in guest RAM, run on a real x86 CPU model (unicorn).

A caller calls a function whose first instruction jumps to the entry
detour; the function returns into its instance's trampoline.  What must
hold: the caller gets back exactly its registers, flags, return value and
stack, the return lands at the real return address, every entry and return
is counted, a call with no free instance counts as missed and still runs,
and every instance is free again afterwards.
"""

from __future__ import annotations

import struct

import pytest

unicorn = pytest.importorskip("unicorn", reason="unicorn is not installed; it only cross-checks the arch layer")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from unicorn import x86_const as X  # noqa: E402

from qprobe.arch.x86_64.detour import FRAME_REGS  # noqa: E402
from qprobe.arch.x86_64.retdetour import (  # noqa: E402
    I_MODE,
    I_OWNER,
    I_RET,
    I_SLOT,
    I_TASK,
    INSTANCE_SIZE,
    MODE_MAILBOX,
    TRAMPOLINE_ID,
    Pool,
    RetParams,
    build_entry_detour,
    build_trampolines,
)

CALLER, DETOUR, BODY, TRAMPS, STUB = 0x10000000, 0x11000000, 0x12000000, 0x13000000, 0x14000000
INSTANCES, COUNTERS, PERCPU, TASK, STACK = 0x20000000, 0x21000000, 0x22000000, 0x23000000, 0x60008000
CURRENT_TASK, OWNER, NINSTANCES = 0x200, 5, 8
HITS, MISSED, RETURNS = COUNTERS, COUNTERS + 8, COUNTERS + 0x100
UC = {name: getattr(X, f"UC_X86_REG_{name.upper()}") for name in FRAME_REGS}
PARAMS = RetParams(INSTANCES, NINSTANCES, TRAMPS, RETURNS, STUB, CURRENT_TASK)
RETVAL = 0x1234_5678_9ABC
# The function: recurse while r15 > 1 (r15 counts down), then return RETVAL in rax.
#   dec r15; jz leaf; call DETOUR; leaf: mov rax, RETVAL; ret    (r15 is restored by the caller's test)
FUNCTION = bytes.fromhex("49ffcf") + b"\x74\x05" + b"\xe8" + (DETOUR - (BODY + 10)).to_bytes(4, "little", signed=True)
FUNCTION += b"\x48\xb8" + RETVAL.to_bytes(8, "little") + b"\xc3"


def machine(pool: Pool, mode: int = 0) -> unicorn.Uc:
    uc = unicorn.Uc(unicorn.UC_ARCH_X86, unicorn.UC_MODE_64)
    for base in (CALLER, DETOUR, BODY, TRAMPS, STUB, INSTANCES, COUNTERS, PERCPU, TASK):
        uc.mem_map(base, 0x100000)
    uc.mem_map(STACK - 0x8000, 0x10000)
    uc.msr_write(0xC0000101, PERCPU)  # GS base
    uc.mem_write(PERCPU + CURRENT_TASK, TASK.to_bytes(8, "little"))
    # The caller: call the function (its first instruction is the jmp to the detour), then stop.
    uc.mem_write(CALLER, b"\xe8" + (DETOUR - (CALLER + 5)).to_bytes(4, "little", signed=True) + b"\xf4")
    code, _ = build_entry_detour(DETOUR, PARAMS, pool, HITS, MISSED, b"", BODY)
    uc.mem_write(DETOUR, code)
    uc.mem_write(BODY, FUNCTION)
    uc.mem_write(TRAMPS, build_trampolines(PARAMS))
    uc.mem_write(STUB, b"\xf4")
    for i in range(pool.first, pool.first + pool.count):  # what the host writes when it gives out the slice
        uc.mem_write(INSTANCES + i * INSTANCE_SIZE + I_OWNER, pool.owner.to_bytes(4, "little"))
        uc.mem_write(INSTANCES + i * INSTANCE_SIZE + I_MODE, mode.to_bytes(4, "little"))
    return uc


def u64(uc: unicorn.Uc, addr: int) -> int:
    return struct.unpack("<Q", uc.mem_read(addr, 8))[0]


def call(uc: unicorn.Uc, regs: dict[str, int], flags: int, depth: int = 1) -> dict[str, int]:
    for name, value in regs.items():
        uc.reg_write(UC[name], value)
    uc.reg_write(X.UC_X86_REG_R15, depth)
    uc.reg_write(X.UC_X86_REG_RSP, STACK)
    uc.reg_write(X.UC_X86_REG_EFLAGS, flags)
    uc.emu_start(CALLER, CALLER + 5, count=10_000)
    assert uc.reg_read(X.UC_X86_REG_RIP) == CALLER + 5  # the real return address
    assert uc.reg_read(X.UC_X86_REG_RSP) == STACK
    return {name: uc.reg_read(UC[name]) for name in FRAME_REGS}


ARITH_FLAGS = st.sets(st.sampled_from([0x1, 0x4, 0x10, 0x40, 0x80, 0x800])).map(lambda s: 0x202 | sum(s))
REGS = st.fixed_dictionaries({name: st.integers(0, 2**64 - 1) for name in FRAME_REGS if name != "r15"})


@settings(max_examples=40, deadline=None)
@given(REGS, ARITH_FLAGS, st.integers(1, 3))
def test_calls_return_through_their_instances_with_everything_preserved(
    regs: dict[str, int], flags: int, calls: int
) -> None:
    pool = Pool(first=2, count=3, owner=OWNER)
    uc = machine(pool)
    for n in range(1, calls + 1):
        out = call(uc, regs, flags)
        # The function's own effects: rax is its return value, r15 it counted down; nothing else moved.
        assert out == {**regs, "rax": RETVAL, "r15": 0}
        # Its `mov` and `ret` left the flags the trampoline restored (its dec set ZF and PF).
        assert uc.reg_read(X.UC_X86_REG_EFLAGS) & 0x200
        assert (u64(uc, HITS), u64(uc, MISSED), u64(uc, RETURNS + OWNER * 8)) == (n, 0, n)
    first = INSTANCES + pool.first * INSTANCE_SIZE
    # The instance was taken (it holds the real return address and the task) and freed.
    assert u64(uc, first + I_SLOT) == 0
    assert (u64(uc, first + I_RET), u64(uc, first + I_TASK)) == (CALLER + 5, TASK)
    # Nothing outside the probe's slice was touched.
    assert all(u64(uc, INSTANCES + i * INSTANCE_SIZE + I_RET) == 0 for i in range(NINSTANCES) if i != pool.first)


@pytest.mark.parametrize("depth, size", [(3, 3), (5, 2), (4, 1)])
def test_recursion_beyond_the_pool_counts_missed_and_every_call_still_returns(depth: int, size: int) -> None:
    pool = Pool(first=0, count=size, owner=OWNER)
    uc = machine(pool)
    regs = {name: 0x1000 + i for i, name in enumerate(FRAME_REGS) if name != "r15"}
    assert call(uc, regs, 0x202, depth) == {**regs, "rax": RETVAL, "r15": 0}
    probed = min(depth, size)
    assert (u64(uc, HITS), u64(uc, MISSED), u64(uc, RETURNS + OWNER * 8)) == (depth, depth - probed, probed)
    assert all(u64(uc, INSTANCES + i * INSTANCE_SIZE + I_SLOT) == 0 for i in range(NINSTANCES))


def test_an_instance_left_by_a_call_that_never_returned_is_reused_for_its_slot() -> None:
    pool = Pool(first=0, count=1, owner=OWNER)
    uc = machine(pool)
    # The only instance claims the slot the next call's return address will use, with a stale address.
    uc.mem_write(INSTANCES + I_SLOT, (STACK - 8).to_bytes(8, "little"))
    uc.mem_write(INSTANCES + I_RET, (0xDEAD).to_bytes(8, "little"))
    call(uc, {}, 0x202)
    assert (u64(uc, HITS), u64(uc, MISSED), u64(uc, RETURNS + OWNER * 8)) == (1, 0, 1)
    assert u64(uc, INSTANCES + I_SLOT) == 0


def test_mailbox_mode_hands_the_return_registers_to_the_stub() -> None:
    pool = Pool(first=1, count=2, owner=OWNER)
    uc = machine(pool, MODE_MAILBOX)
    regs = {name: 0x2000 + i for i, name in enumerate(FRAME_REGS) if name != "r15"}
    for name, value in regs.items():
        uc.reg_write(UC[name], value)
    uc.reg_write(X.UC_X86_REG_R15, 1)
    uc.reg_write(X.UC_X86_REG_RSP, STACK)
    uc.reg_write(X.UC_X86_REG_EFLAGS, 0x202 | 0x1)
    uc.emu_start(CALLER, STUB, count=10_000)
    rsp = uc.reg_read(X.UC_X86_REG_RSP)
    # As after `push id; call stub` in a detour: the probed context's rsp (just past the slot) is rsp + 16.
    assert rsp + 16 == STACK and u64(uc, rsp + 8) == TRAMPOLINE_ID
    assert {name: uc.reg_read(UC[name]) for name in regs} == {**regs, "rax": RETVAL}
    assert uc.reg_read(X.UC_X86_REG_EFLAGS) & 0x200  # interrupts back on, as at the return
    instance = INSTANCES + pool.first * INSTANCE_SIZE
    # Still owned: the host reads it by slot and frees it when it answers.
    assert (u64(uc, instance + I_SLOT), u64(uc, instance + I_RET)) == (STACK - 8, CALLER + 5)
    assert u64(uc, RETURNS + OWNER * 8) == 0
