"""x86's guest calls (qprobe.arch.x86_64.guestcall) run on a CPU model (unicorn), at kernel addresses.

The queue stub is entered as the host's hijack makes a stopped vCPU enter it (arch_call_from) and must come
back to where the vCPU was with every register, the flags and the stack as they were, having marked the
block queued and called queue_work_on(this CPU, *wq_var, block).  The work function, called by a kworker
with the block's work_struct, must make the block's call and leave its result; the counting handler must
count and return 0.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

unicorn = pytest.importorskip("unicorn", reason="unicorn is not installed; it only cross-checks the arch layer")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from iced_x86 import BlockEncoder, Code, Instruction, Register  # noqa: E402
from kernelcpu_x86_64 import CALLEE_SAVED, CALLER_SAVED, KernelCpu  # noqa: E402

from qprobe.arch.guestcall import (  # noqa: E402
    BLOCK_ARGS,
    BLOCK_DONE,
    BLOCK_FN,
    BLOCK_QUEUE,
    BLOCK_QUEUED,
    BLOCK_RET,
    BLOCK_SIZE,
    BLOCK_WORK,
)
from qprobe.arch.x86_64.detour import _mem  # noqa: E402
from qprobe.arch.x86_64.guestcall import X86GuestCall  # noqa: E402
from qprobe.core.guestcall import block_image  # noqa: E402

TEXT = 0xFFFF_FFFF_8100_0000  # the kernel's functions (the test's stand-ins)
QUEUE_WORK_ON, CALLEE, RESUME = TEXT, TEXT + 0x100, TEXT + 0x1000  # RESUME: where the vCPU was (hlt)
DATA = 0xFFFF_FFFF_8200_0000
WQ_VAR, RECORD = DATA, DATA + 0x100  # system_wq; what the stand-ins saw
SCRATCH = 0xFFFF_FFFF_A000_0000
BLOCK, COUNTER = SCRATCH + 0x100, SCRATCH + 0x1000
PERCPU, CPU_NUMBER, CPU = 0xFFFF_8880_1F00_0000, 0x1F0A4, 3  # GS base, cpu_number's per-CPU offset
STACK = 0xFFFF_C900_0001_0000
WQ = 0xFFFF_8880_0010_0A00
WORK_ENTRY, WORK_FUNC = 8, 24  # struct work_struct's entry and func
UC = CALLER_SAVED + CALLEE_SAVED
WORD = st.integers(0, (1 << 64) - 1)
ARITH_FLAGS = st.sets(st.sampled_from([0x1, 0x4, 0x10, 0x40, 0x80, 0x800])).map(lambda s: 0x202 | sum(s))
GC = X86GuestCall()


def encode(code: list[Instruction], address: int) -> bytes:
    enc = BlockEncoder(64)
    enc.add_many(code)
    return bytes(enc.encode(address))


def store(reg: Register, addr: int) -> Instruction:
    return Instruction.create_mem_reg(Code.MOV_RM64_R64, _mem(disp=addr), reg)


def clobber() -> list[Instruction]:
    """What a C function may do: every caller-saved register and the flags changed."""
    c = Instruction
    regs = (Register.RAX, Register.RCX, Register.RDX, Register.RSI, Register.RDI,
            Register.R8, Register.R9, Register.R10, Register.R11)  # fmt: skip
    out = [c.create_reg_u64(Code.MOV_R64_IMM64, r, 0x5A5A_0000_0000_0000 + i) for i, r in enumerate(regs)]
    return [*out, c.create_reg_i32(Code.CMP_RM64_IMM8, Register.RAX, 1)]  # CF, ZF... all set anew


def queue_work_on() -> bytes:
    """Records (cpu, wq, work) and the block's queued flag as it is at the call, returns true."""
    c = Instruction
    code = [store(Register.RDI, RECORD), store(Register.RSI, RECORD + 8), store(Register.RDX, RECORD + 16),
            c.create_reg_mem(Code.MOV_R64_RM64, Register.RAX, _mem(disp=BLOCK + BLOCK_QUEUED)),
            store(Register.RAX, RECORD + 24), store(Register.RSP, RECORD + 32), *clobber(),
            c.create_reg_i32(Code.MOV_R32_IMM32, Register.EAX, 1), c.create(Code.RETNQ)]  # fmt: skip
    return encode(code, QUEUE_WORK_ON)


def callee() -> bytes:
    """The block's function: records its four arguments, returns a value of its own."""
    c = Instruction
    code = [*(store(r, RECORD + 8 * i) for i, r in enumerate((Register.RDI, Register.RSI, Register.RDX, Register.RCX))),
            *clobber(), c.create_reg_u64(Code.MOV_R64_IMM64, Register.RAX, 0xFFFF_8880_0C0F_FEE0),
            c.create(Code.RETNQ)]  # fmt: skip
    return encode(code, CALLEE)


def fake_kernel() -> Any:
    symbols = {"queue_work_on": QUEUE_WORK_ON, "system_wq": WQ_VAR}
    offsets = {"entry": WORK_ENTRY, "func": WORK_FUNC}
    return SimpleNamespace(symbols=SimpleNamespace(address=symbols.__getitem__),
                           type_offset=lambda t, m: offsets[m], percpu_offset=lambda n: CPU_NUMBER)  # fmt: skip


def machine() -> KernelCpu:
    maps = ((TEXT, 0x2000), (DATA, 0x1000), (SCRATCH, 0x2000), (PERCPU, 0x20000), (STACK - 0x4000, 0x8000))
    cpu = KernelCpu(maps, PERCPU)
    cpu.write(QUEUE_WORK_ON, queue_work_on())
    cpu.write(CALLEE, callee())
    cpu.write(RESUME, b"\xf4")
    cpu.write(WQ_VAR, WQ.to_bytes(8, "little"))
    cpu.write(PERCPU + CPU_NUMBER, CPU.to_bytes(4, "little") + b"\xff" * 4)  # an int: the rest is not its
    cpu.write(BLOCK, block_image(GC, fake_kernel(), BLOCK))
    return cpu


def test_the_block_image_lays_out_work_and_code() -> None:
    image = block_image(GC, fake_kernel(), BLOCK)
    assert len(image) == BLOCK_SIZE
    assert image[:WORK_ENTRY] == bytes(WORK_ENTRY)  # data: not pending, pool 0
    assert image[WORK_ENTRY : WORK_ENTRY + 16] == (BLOCK + WORK_ENTRY).to_bytes(8, "little") * 2  # an empty list
    assert int.from_bytes(image[WORK_FUNC : WORK_FUNC + 8], "little") == BLOCK + BLOCK_WORK
    assert image[BLOCK_FN:BLOCK_QUEUE] == bytes(BLOCK_QUEUE - BLOCK_FN)  # no call yet
    assert image[BLOCK_WORK : BLOCK_WORK + 4] == bytes.fromhex("f30f1efa")  # endbr64: called indirectly


@settings(max_examples=30, deadline=None, database=None)
@given(values=st.lists(WORD, min_size=len(UC), max_size=len(UC)), flags=ARITH_FLAGS,
       sp=st.integers(0, 0x7F).map(lambda n: STACK - 8 * n))  # fmt: skip
def test_the_queue_stub_queues_the_work_and_returns_with_everything_kept(
    values: list[int], flags: int, sp: int
) -> None:
    cpu = machine()
    before = dict(zip(UC, values, strict=True))
    for name, value in before.items():
        cpu.reg(name, value)
    cpu.reg("eflags", flags)
    # The vCPU stopped at the interrupt exit, made to call the stub as the host's hijack does.
    new_sp, data, new = GC.arch_call_from({"rsp": sp, "rip": RESUME}, BLOCK + BLOCK_QUEUE)
    cpu.write(new_sp, data)
    cpu.call(new["rip"], new["rsp"], RESUME)
    assert cpu.reg("rsp") == sp and cpu.regs() == before
    assert cpu.reg("eflags") & 0xFFF == flags
    wq_cpu, wq, work, queued_at_call, rsp_at_call = (cpu.word(RECORD + 8 * i) for i in range(5))
    assert (wq_cpu, wq, work) == (CPU, WQ, BLOCK)
    assert queued_at_call == 1 and cpu.word(BLOCK + BLOCK_QUEUED) == 1  # set before the call
    assert rsp_at_call < new_sp  # the call's frame below the return address
    assert cpu.word(BLOCK + BLOCK_DONE) == 0  # only the kworker makes the call


@settings(max_examples=20, deadline=None, database=None)
@given(args=st.lists(WORD, min_size=4, max_size=4), callee_saved=st.lists(WORD, min_size=6, max_size=6))
def test_the_work_function_makes_the_blocks_call(args: list[int], callee_saved: list[int]) -> None:
    cpu = machine()
    cpu.write(BLOCK + BLOCK_FN, CALLEE.to_bytes(8, "little"))
    cpu.write(BLOCK + BLOCK_ARGS, b"".join(a.to_bytes(8, "little") for a in args))
    kept = dict(zip(CALLEE_SAVED, callee_saved, strict=True))
    for name, value in kept.items():
        cpu.reg(name, value)
    # The kworker: work->func(work).
    cpu.write(STACK - 8, RESUME.to_bytes(8, "little"))
    cpu.reg("rdi", BLOCK)
    cpu.call(cpu.word(BLOCK + WORK_FUNC), STACK - 8, RESUME)
    assert cpu.reg("rsp") == STACK
    assert [cpu.word(RECORD + 8 * i) for i in range(4)] == args
    assert cpu.word(BLOCK + BLOCK_RET) == 0xFFFF_8880_0C0F_FEE0 and cpu.word(BLOCK + BLOCK_DONE) == 1
    assert {name: value for name, value in cpu.regs().items() if name in CALLEE_SAVED} == kept


def test_the_count_handler_counts_and_keeps_the_breakpoint() -> None:
    cpu = machine()
    handler = SCRATCH + 0x1040
    cpu.write(handler, GC.build_count_handler(handler, COUNTER))
    cpu.write(COUNTER, (41).to_bytes(8, "little"))
    for hit in range(3):
        cpu.reg("rax", 0xFFFF_FFFF_FFFF_FFFF)
        cpu.write(STACK - 8, RESUME.to_bytes(8, "little"))
        cpu.call(handler, STACK - 8, RESUME)
        assert cpu.reg("rax") == 0  # 0: the breakpoint stays (UPROBE_HANDLER_REMOVE is 1)
        assert cpu.reg("rsp") == STACK
        assert cpu.word(COUNTER) == 42 + hit
    assert cpu.read(handler, 4) == bytes.fromhex("f30f1efa")  # endbr64: the kernel calls it indirectly


def test_arch_call_from_pushes_the_return_to_where_the_vcpu_was() -> None:
    regs = {"rsp": STACK, "rip": 0xFFFF_FFFF_8123_4567, "rax": 7}
    assert GC.arch_call_from(regs, BLOCK + BLOCK_QUEUE) == (
        STACK - 8,
        (0xFFFF_FFFF_8123_4567).to_bytes(8, "little"),
        {"rsp": STACK - 8, "rip": BLOCK + BLOCK_QUEUE},
    )
    sp, _, new = GC.arch_call_from({"rsp": 0, "rip": 1}, 2)
    assert sp == new["rsp"] == (1 << 64) - 8  # 64-bit arithmetic
