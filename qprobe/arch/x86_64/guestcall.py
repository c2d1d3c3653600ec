"""x86's guest calls (qprobe.arch.guestcall): the queue stub, the work function and a counting uprobe handler."""

from __future__ import annotations

from collections.abc import Mapping

from iced_x86 import BlockEncoder, Code, Instruction, Register

from qprobe.arch.guestcall import BLOCK_ARGS, BLOCK_DONE, BLOCK_FN, BLOCK_QUEUED, BLOCK_RET
from qprobe.arch.inguest import KeySpec
from qprobe.arch.x86_64.detour import _mem, locked_inc
from qprobe.arch.x86_64.guestagg import keyed_code

# Every register a C call may change (the SysV ABI's caller-saved ones): the stub keeps them for the
# interrupted context, whose compiler did not expect a call there.
_CLOBBERED = (Register.RAX, Register.RCX, Register.RDX, Register.RSI, Register.RDI,
              Register.R8, Register.R9, Register.R10, Register.R11)  # fmt: skip
_ARGS = (Register.RDI, Register.RSI, Register.RDX, Register.RCX)
_MASK = (1 << 64) - 1


def _encode(code: list[Instruction], address: int) -> bytes:
    enc = BlockEncoder(64)
    enc.add_many(code)
    return bytes(enc.encode(address))


def _handler(body: list[Instruction], address: int) -> bytes:
    """A uprobe_consumer handler at ``address``: ``body``, then return 0 (keep the breakpoint).  It starts with
    endbr64: the kernel calls it indirectly, which a kernel with IBT checks."""
    c = Instruction
    return _encode([c.create(Code.ENDBR64), *body, c.create_reg_reg(Code.XOR_R32_RM32, Register.EAX, Register.EAX),
                    c.create(Code.RETNQ)], address)  # fmt: skip


class X86GuestCall:
    # Since Linux 5.9 ("x86/entry: Use idtentry for interrupts"), every device and system interrupt
    # leaves through irq_exit_rcu(), still in hard-irq context.
    interrupt_exit = "irq_exit_rcu"

    def build_queue_stub(self, address: int, queue_work_on: int, wq_var: int, work: int, cpu_number: int) -> bytes:
        c = Instruction
        code = [c.create(Code.PUSHFQ), *(c.create_reg(Code.PUSH_R64, r) for r in _CLOBBERED)]
        code += [
            c.create_reg_mem(Code.MOV_R32_RM32, Register.EDI, _mem(disp=cpu_number, seg="gs")),
            c.create_reg_u64(Code.MOV_R64_IMM64, Register.RAX, wq_var),
            c.create_reg_mem(Code.MOV_R64_RM64, Register.RSI, _mem("rax")),
            c.create_reg_u64(Code.MOV_R64_IMM64, Register.RDX, work),
            c.create_mem_i32(Code.MOV_RM64_IMM32, _mem("rdx", BLOCK_QUEUED), 1),
            c.create_reg_u64(Code.MOV_R64_IMM64, Register.RAX, queue_work_on),
            c.create_reg(Code.CALL_RM64, Register.RAX),
        ]
        code += [*(c.create_reg(Code.POP_R64, r) for r in reversed(_CLOBBERED)), c.create(Code.POPFQ)]
        code.append(c.create(Code.RETNQ))
        return _encode(code, address)

    def build_work_function(self, address: int) -> bytes:
        c = Instruction
        # endbr64: the kworker calls work->func indirectly, which a kernel with IBT checks.
        code = [c.create(Code.ENDBR64), c.create_reg(Code.PUSH_R64, Register.RBX),
                c.create_reg_reg(Code.MOV_R64_RM64, Register.RBX, Register.RDI)]  # fmt: skip
        # Its argument is the work_struct, which is the block's start.
        code += [
            c.create_reg_mem(Code.MOV_R64_RM64, reg, _mem("rbx", BLOCK_ARGS + 8 * i)) for i, reg in enumerate(_ARGS)
        ]
        code += [
            c.create_mem(Code.CALL_RM64, _mem("rbx", BLOCK_FN)),
            c.create_mem_reg(Code.MOV_RM64_R64, _mem("rbx", BLOCK_RET), Register.RAX),
            c.create_mem_i32(Code.MOV_RM64_IMM32, _mem("rbx", BLOCK_DONE), 1),
            c.create_reg(Code.POP_R64, Register.RBX),
            c.create(Code.RETNQ),
        ]
        return _encode(code, address)

    def build_count_handler(self, address: int, counter: int) -> bytes:
        return _handler([locked_inc(counter)], address)

    def build_keyed_handler(self, address: int, spec: KeySpec, tables: int, cpu_number: int,
                            task: tuple[int, int, int], hits: int, lost: int) -> bytes:  # fmt: skip
        # The key's registers from the struct pt_regs the kernel passes (the second argument, in rsi).
        return _handler(keyed_code(spec, tables, cpu_number, task, hits, lost, Register.RSI), address)

    def arch_call_from(self, regs: Mapping[str, int], stub: int) -> tuple[int, bytes, dict[str, int]]:
        # A call: the return address below the stack pointer (the kernel has no red zone: -mno-red-zone).
        sp = (regs["rsp"] - 8) & _MASK
        return sp, regs["rip"].to_bytes(8, "little"), {"rsp": sp, "rip": stub}


__all__ = ["X86GuestCall"]
