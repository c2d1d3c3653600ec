"""Where the host hears of a guest int3 without making QEMU 7.2 throw its translated code away.

A gdb breakpoint on the #BP entry works, but every breakpoint (and
single-step) stop runs ``tb_flush()`` in QEMU 7.2's gdbstub, and the guest
then spends ~100 ms re-translating what it runs: that, not the host, is the
cost of a stop-based probe hit.  A *watchpoint* stop skips the flush.  A read
watchpoint on the IDT gate itself would fire inside exception delivery, where
QEMU 7.2 holds the iothread lock and aborts (measured); so the watchpoint goes
on the first memory read the kernel's #BP handler makes: ``poke_int3_handler``
reads ``bp_desc.refs`` (text_poke_bp's descriptor) for every int3 from kernel
mode, with the trap's ``struct pt_regs *`` still in ``rdi``.  QEMU reports the
hit after that instruction; the pt_regs hold every register of the trapped
context, so the host restores them and handles the trap as if the vCPU had
stopped on the int3 itself.  User-mode int3s return before that read and never
stop the VM.
"""

from __future__ import annotations

from iced_x86 import Decoder, Instruction, InstructionInfoFactory, OpAccess, Register

MAX_INSNS = 12  # the read is in the handler's first few instructions

_WRITES = (OpAccess.WRITE, OpAccess.READ_WRITE, OpAccess.COND_WRITE, OpAccess.READ_COND_WRITE)
_RDI = (Register.RDI, Register.EDI, Register.DI, Register.DIL)


def _writes_rdi(info: InstructionInfoFactory, insn: Instruction) -> bool:
    return any(u.register in _RDI and u.access in _WRITES for u in info.info(insn).used_registers())


def watch_site(code: bytes, address: int, refs: int) -> frozenset[int] | None:
    """Where a vCPU can be when the watchpoint on ``refs`` reports poke_int3_handler's read of it.

    ``code`` is poke_int3_handler at ``address``.  QEMU reports the hit at the
    start of the next translated block, which is right after the read or, when
    the branch that follows it was taken, at that branch's target.  The set
    holds every such ip up to the first instruction that writes memory (the
    ``lock cmpxchg`` taking a reference: past it the trap cannot be taken
    back); along that path ``rdi`` still holds the trap's pt_regs.  None
    unless the read comes within the first instructions, with no call, jump
    or write to ``rdi`` before it.
    """
    info = InstructionInfoFactory()
    insns = list(Decoder(64, code, ip=address))
    read = next((n for n, i in enumerate(insns[:MAX_INSNS]) if i.memory_displacement == refs and i.op_count == 2), None)
    if read is None or any(i.is_call_near or i.is_jmp_short_or_near or i.code == 0 or _writes_rdi(info, i)
                           for i in insns[:read]):  # fmt: skip
        return None
    safe = set()
    for insn in insns[read + 1 : read + 1 + MAX_INSNS]:
        safe.add(insn.ip)
        if _writes_rdi(info, insn) or insn.is_call_near or insn.is_jmp_short_or_near or insn.code == 0 or \
                any(m.access in _WRITES for m in info.info(insn).used_memory()):  # fmt: skip
            break
        if insn.is_jcc_short_or_near:
            safe.add(insn.near_branch_target)
    return frozenset(safe)
