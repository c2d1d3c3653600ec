"""An event filter compiled to x86 for a record detour: hits it rejects never reach the ring.

The filter is the tree qprobe.fetch.filter parses (``Pred``, ``And``, ``Or``,
``Not``), bound by qprobe.events: every ``Pred`` compares a field the guest
has in a register (its ``at``: a 64- or 32-bit integer) with a constant.
``build_filtered_detour`` lays out::

        pushfq; push rax; push rdx
        <the tree: short-circuit compares and jumps to T or F>
    F:  lock inc qword [filtered]; pop rdx; pop rax; popfq; jmp CONT
    T:  pop rdx; pop rax; popfq
        push id; call record_stub          ; the stub returns to CONT
    CONT: nop
        <the replaced instructions, relocated>; jmp resume

Every register and flag is as it was at the probe when the record stub (or
the relocated code) runs.  Encoded with iced-x86's BlockEncoder.
"""

from __future__ import annotations

from iced_x86 import Code, Instruction, Register

from qprobe.arch.inguest import GuestFilter
from qprobe.arch.x86_64.detour import _mem, _r, encode_detour
from qprobe.arch.x86_64.ptregs import GDB_NAME, PT_GPRS, PT_NAME
from qprobe.fetch.filter import And, GuestReg, Not, Or, Pred

# The registers a filter may compare (pt_regs names): RegisterLayout.general.
GPRS = tuple(PT_NAME[g] for g in PT_GPRS)
# op -> (signed jcc, unsigned jcc) taken when the predicate holds
_JCC = {
    "==": (Code.JE_REL32_64, Code.JE_REL32_64), "!=": (Code.JNE_REL32_64, Code.JNE_REL32_64),
    "<": (Code.JL_REL32_64, Code.JB_REL32_64), "<=": (Code.JLE_REL32_64, Code.JBE_REL32_64),
    ">": (Code.JG_REL32_64, Code.JA_REL32_64), ">=": (Code.JGE_REL32_64, Code.JAE_REL32_64),
    "&": (Code.JNE_REL32_64, Code.JNE_REL32_64),
}  # fmt: skip


class _Compiler:
    def __init__(self) -> None:
        self.code: list[Instruction] = []
        self._next_label = 1

    def label(self) -> int:
        self._next_label += 1
        return self._next_label

    def place(self, label: int) -> None:
        nop = Instruction.create(Code.NOPD)
        nop.ip = label
        self.code.append(nop)

    def cond(self, node: GuestFilter, true: int, false: int) -> None:
        match node:
            case Pred(op=op, const=int() as const, at=GuestReg() as at):
                self.pred(at, op, const, true, false)
            case And(parts):
                for part in parts[:-1]:
                    nxt = self.label()
                    self.cond(part, nxt, false)
                    self.place(nxt)
                self.cond(parts[-1], true, false)
            case Or(parts):
                for part in parts[:-1]:
                    nxt = self.label()
                    self.cond(part, true, nxt)
                    self.place(nxt)
                self.cond(parts[-1], true, false)
            case Not(inner):
                self.cond(inner, false, true)
            case _:  # an unbound leaf: qprobe.events keeps such a filter on the host
                raise TypeError(f"not a filter node the guest can test: {node!r}")

    def pred(self, at: GuestReg, op: str, const: int, true: int, false: int) -> None:
        c = Instruction
        # Stack: [rsp] = saved rdx, [rsp+8] = saved rax, [rsp+16] = flags.
        if at.reg == "ax":
            self.code.append(c.create_reg_mem(Code.MOV_R64_RM64, Register.RAX, _mem("rsp", 8)))
        elif at.reg == "dx":
            self.code.append(c.create_reg_mem(Code.MOV_R64_RM64, Register.RAX, _mem("rsp", 0)))
        else:
            self.code.append(c.create_reg_reg(Code.MOV_R64_RM64, Register.RAX, _r(GDB_NAME.get(at.reg, at.reg))))
        imm = const & ((1 << at.bits) - 1)
        self.code.append(c.create_reg_u64(Code.MOV_R64_IMM64, Register.RDX, imm))
        if op == "&":
            code = Code.TEST_RM64_R64 if at.bits == 64 else Code.TEST_RM32_R32
        else:
            code = Code.CMP_RM64_R64 if at.bits == 64 else Code.CMP_RM32_R32
        a, d = (Register.RAX, Register.RDX) if at.bits == 64 else (Register.EAX, Register.EDX)
        self.code.append(c.create_reg_reg(code, a, d))
        self.code.append(c.create_branch(_JCC[op][0 if at.signed else 1], true))
        self.code.append(c.create_branch(Code.JMP_REL32_64, false))


def build_filtered_detour(
    address: int, tree: GuestFilter, probe_id: int, stub: int, filtered: int, relocated: bytes, resume: int
) -> tuple[bytes, int]:
    """The detour at ``address`` and the offset where its relocated code starts (right after CONT's nop).

    ``filtered`` is the address of the u64 counting the hits the filter rejected.
    """
    comp = _Compiler()
    true, false, cont = comp.label(), comp.label(), comp.label()
    c = Instruction
    comp.code += [c.create(Code.PUSHFQ), c.create_reg(Code.PUSH_R64, Register.RAX),
                  c.create_reg(Code.PUSH_R64, Register.RDX)]  # fmt: skip
    comp.cond(tree, true, false)
    inc = c.create_mem(Code.INC_RM64, _mem(disp=filtered))
    inc.has_lock_prefix = True
    inc.ip = false
    comp.code += [inc, c.create_reg(Code.POP_R64, Register.RDX), c.create_reg(Code.POP_R64, Register.RAX),
                  c.create(Code.POPFQ), c.create_branch(Code.JMP_REL32_64, cont)]  # fmt: skip
    comp.place(true)
    comp.code += [c.create_reg(Code.POP_R64, Register.RDX), c.create_reg(Code.POP_R64, Register.RAX),
                  c.create(Code.POPFQ), c.create_i32(Code.PUSHQ_IMM32, probe_id),
                  c.create_branch(Code.CALL_REL32_64, stub)]  # fmt: skip
    comp.place(cont)  # the stub's `ret 8` lands here; the relocated code follows the block
    return encode_detour(comp.code, address, relocated, resume)
