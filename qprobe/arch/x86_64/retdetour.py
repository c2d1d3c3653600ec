"""Return probes whose instances live in guest RAM: the entry detour and the return trampolines.

As the kernel's own design (struct kretprobe_instance in a pool
of ``maxactive``): the entry detour of a jump-optimized kretprobe takes a free
instance from its probe's slice of an instance array in the scratch area,
saves the return address in it, and replaces the return address on the stack
with the address of that instance's own trampoline.  The host is not woken.
A trampoline entry is ``push i; jmp common`` (``TRAMP_STRIDE`` bytes), so the
return finds its instance without a search; ``common`` checks that the
instance still belongs to this stack slot and then either counts the return
in guest RAM and jumps to the real return address (mode COUNT: nobody
woken), or hands the return registers to the host through the mailbox stub
(mode MAILBOX), which answers with the real return address.

An instance (``INSTANCE_SIZE`` bytes)::

    0 slot: where the return address lives on the stack (0: free)
    8 the real return address      16 the task (current_task at entry)
    24 owner (u32: the probe's index in the per-owner return counters)
    28 mode (u32: MODE_COUNT or MODE_MAILBOX)

The instance is written before the stack is: whatever the guest has replaced
can be put back from the array alone (after a crash of qprobe too).  A slot
already owned by an instance belongs to a call that never returned (its
frame is gone, the same stack slot is in use again): that instance is
reused.  Both the entry and the return run with interrupts off.
"""

from __future__ import annotations

from dataclasses import dataclass

from iced_x86 import BlockEncoder, Code, Instruction, Register

from qprobe.arch.guestram import Pool
from qprobe.arch.x86_64.boost import synthesize_reljump
from qprobe.arch.x86_64.detour import _mem, encode_detour, locked_inc, restore_regs, save_regs, simm32

INSTANCE_SIZE = 32
I_SLOT, I_RET, I_TASK, I_OWNER, I_MODE = 0, 8, 16, 24, 28
MODE_COUNT, MODE_MAILBOX = 0, 1
TRAMP_STRIDE = 16  # push imm32 (5) + jmp rel32 (5), padded
TRAMPOLINE_ID = 0  # the probe id the mailbox stub hears for a return (the host finds the instance by its slot)


@dataclass(frozen=True)
class RetParams:
    instances: int  # the instance array
    count: int  # instances in it
    trampolines: int  # instance i's trampoline is trampolines + i * TRAMP_STRIDE; ``common`` follows them
    returns: int  # u64 per owner: returns counted in the guest
    stub: int  # the mailbox stub
    current_task: int  # per-CPU offset of current_task

    def trampoline(self, i: int) -> int:
        return self.trampolines + i * TRAMP_STRIDE

    def instance(self, i: int) -> int:
        return self.instances + i * INSTANCE_SIZE


def build_trampolines(p: RetParams) -> bytes:
    """Every instance's trampoline, then the code they share, encoded at ``p.trampolines``."""
    common = p.trampolines + p.count * TRAMP_STRIDE
    out = bytearray()
    for i in range(p.count):
        at = p.trampoline(i)
        entry = bytes([0x68]) + i.to_bytes(4, "little") + synthesize_reljump(at + 5, common)
        out += entry.ljust(TRAMP_STRIDE, b"\xcc")
    return bytes(out) + _common(p, common)


def _common(p: RetParams, address: int) -> bytes:
    # On entry: rsp = slot (the ret consumed the slot, the push of i refilled it), [rsp] = i.
    bad, mailbox = 1, 2
    c = Instruction
    rax, rcx = Register.RAX, Register.RCX
    saved = ("rax", "rcx")
    code = [
        *save_regs(*saved),
        # slot = rsp + 24: flags, rax and rcx above it
        c.create_reg_mem(Code.MOV_R32_RM32, Register.ECX, _mem("rsp", 24)),
        c.create_reg_i32(Code.CMP_RM32_IMM32, Register.ECX, p.count),
        c.create_branch(Code.JAE_REL32_64, bad),
        c.create_reg_i32(Code.SHL_RM64_IMM8, rcx, 5),
        c.create_reg_i32(Code.ADD_RM64_IMM32, rcx, simm32(p.instances)),
        c.create_reg_mem(Code.LEA_R64_M, rax, _mem("rsp", 24)),
        c.create_reg_mem(Code.CMP_R64_RM64, rax, _mem("rcx", I_SLOT)),
        c.create_branch(Code.JNE_REL32_64, bad),
        c.create_mem_i32(Code.CMP_RM32_IMM8, _mem("rcx", I_MODE), MODE_COUNT),
        c.create_branch(Code.JNE_REL32_64, mailbox),
        c.create_reg_mem(Code.MOV_R32_RM32, Register.EAX, _mem("rcx", I_OWNER)),
    ]
    inc = c.create_mem(Code.INC_RM64, _mem(None, p.returns, "rax", 8))
    inc.has_lock_prefix = True
    code += [
        inc,
        c.create_reg_mem(Code.MOV_R64_RM64, rax, _mem("rcx", I_RET)),
        c.create_mem_reg(Code.MOV_RM64_R64, _mem("rsp", 24), rax),
        # Freed last: from here the instance may be taken by another call.
        c.create_mem_i32(Code.MOV_RM64_IMM32, _mem("rcx", I_SLOT), 0),
        *restore_regs(*saved),
        c.create(Code.RETNQ),  # to the real return address, rsp = slot + 8
    ]
    code += [
        *restore_regs(*saved, label=mailbox),
        # The registers are the function's at its return; the host finds the instance by slot = rsp.
        c.create_mem_i32(Code.MOV_RM64_IMM32, _mem("rsp"), TRAMPOLINE_ID),
        c.create_branch(Code.CALL_REL32_64, p.stub),
        c.create(Code.INT3),  # the mailbox was busy (an NMI inside a probe): the stop path finishes the return
    ]
    code += [*restore_regs(*saved, label=bad), c.create(Code.INT3)]
    enc = BlockEncoder(64)
    enc.add_many(code)
    return bytes(enc.encode(address))


def common_offsets(p: RetParams) -> tuple[int, int]:
    """Where, from ``common``, the two int3s are: (after the mailbox call, the bad-instance one)."""
    code = _common(p, p.trampolines + p.count * TRAMP_STRIDE)
    first = code.index(b"\xcc")
    return first, len(code) - 1


def build_entry_detour(
    address: int, p: RetParams, pool: Pool, hits: int, missed: int, relocated: bytes, resume: int
) -> tuple[bytes, int]:
    """The entry detour at ``address`` and the offset its relocated instructions start at.

    ``hits`` and ``missed`` are the probe's u64 counters: every entry, and the
    entries that found no free instance (the kretprobe's nmissed).
    """
    scan_same, scan_free, claimed, out = 1, 2, 3, 4
    c = Instruction
    rax, rcx, rdx = Register.RAX, Register.RCX, Register.RDX
    start, end = p.instance(pool.first), p.instance(pool.first + pool.count)

    imm = simm32
    saved = ("rax", "rcx", "rdx")
    code = [
        *save_regs(*saved),
        locked_inc(hits),
        c.create_reg_mem(Code.LEA_R64_M, rdx, _mem("rsp", 32)),  # the return address's slot
        c.create_reg_i32(Code.MOV_RM64_IMM32, rcx, imm(start)),
    ]
    same = c.create_reg_mem(Code.CMP_R64_RM64, rdx, _mem("rcx", I_SLOT))
    same.ip = scan_same
    code += [
        same,
        c.create_branch(Code.JE_REL32_64, claimed),
        c.create_reg_i32(Code.ADD_RM64_IMM8, rcx, INSTANCE_SIZE),
        c.create_reg_i32(Code.CMP_RM64_IMM32, rcx, imm(end)),
        c.create_branch(Code.JB_REL32_64, scan_same),
        c.create_reg_i32(Code.MOV_RM64_IMM32, rcx, imm(start)),
    ]
    free = c.create_reg_reg(Code.XOR_R32_RM32, Register.EAX, Register.EAX)
    free.ip = scan_free
    take = c.create_mem_reg(Code.CMPXCHG_RM64_R64, _mem("rcx", I_SLOT), rdx)
    take.has_lock_prefix = True
    code += [
        free,
        take,
        c.create_branch(Code.JE_REL32_64, claimed),
        c.create_reg_i32(Code.ADD_RM64_IMM8, rcx, INSTANCE_SIZE),
        c.create_reg_i32(Code.CMP_RM64_IMM32, rcx, imm(end)),
        c.create_branch(Code.JB_REL32_64, scan_free),
        locked_inc(missed),
        c.create_branch(Code.JMP_REL32_64, out),
    ]
    got = c.create_reg_mem(Code.MOV_R64_RM64, rax, _mem("rdx"))
    got.ip = claimed
    code += [
        got,
        c.create_mem_reg(Code.MOV_RM64_R64, _mem("rcx", I_RET), rax),
        c.create_reg_mem(Code.MOV_R64_RM64, rax, _mem(disp=p.current_task, seg="gs")),
        c.create_mem_reg(Code.MOV_RM64_R64, _mem("rcx", I_TASK), rax),
        # trampoline = trampolines + (instance - instances) / INSTANCE_SIZE * TRAMP_STRIDE
        c.create_reg_reg(Code.MOV_R64_RM64, rax, rcx),
        c.create_reg_i32(Code.SUB_RM64_IMM32, rax, imm(p.instances)),
        c.create_reg_i32(Code.SHR_RM64_IMM8, rax, 1),
        c.create_reg_i32(Code.ADD_RM64_IMM32, rax, imm(p.trampolines)),
        # The stack last: the instance already says how to undo it.
        c.create_mem_reg(Code.MOV_RM64_R64, _mem("rdx"), rax),
    ]
    code += restore_regs(*saved, label=out)
    return encode_detour(code, address, relocated, resume)
