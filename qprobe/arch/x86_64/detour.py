"""Code for optimized probes: the shared mailbox stub and the per-probe detour.

A probe's first instructions are replaced by ``jmp detour``.  The detour is::

    push  $probe_id
    call  stub                  ; never returns here: the stub resumes at FINAL_IP
  continue:
    <the replaced instructions, relocated>
    jmp   addr + replaced_length

The stub saves the registers as a frame on the stack, copies them into this
CPU's mailbox in the scratch area, rings the doorbell (an ``out`` to QEMU's
isa-debugcon port, whose chardev is a socket the host reads) and spins until
the host has run the handlers and answered.  It then reloads the (possibly
changed) registers and leaves through ``pop rsp; ret`` so that the host can
choose both the stack pointer and the ip to resume at: ``continue`` for a
normal hit, anything else when a pre_handler changed ``regs.ip`` to skip the
instruction.  Interrupts stay disabled while the mailbox is in use; a probe
hit on a CPU whose mailbox is busy (an NMI) only counts ``nmissed``.

The stub's frame is a ``struct pt_regs`` (qprobe.arch.x86_64.ptregs), laid
out as the kernel's optprobe trampoline lays out its own: ``push rsp;
pushfq``, room for cs, ip and orig_ax, the general registers in pt_regs
order; the sp slot is then moved past the detour's two pushes to the probed
context's rsp.  ss is not saved: that word is the return into the detour
that ``call stub`` pushed, and the probe id follows it::

    0 r15 .. 112 di   120 orig_ax  128 ip  136 cs (none of the three written)
    144 flags  152 sp  160 return into detour  168 probe id  176 = the context's rsp
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from iced_x86 import BlockEncoder, Code, Instruction, MemoryOperand, Register, RepPrefixKind

if TYPE_CHECKING:
    # iced_x86.Register is a module of constants at run time; its members' type is this enum.
    from iced_x86._iced_x86_py import Register as RegisterKind

from qprobe.arch.x86_64.boost import synthesize_relcall, synthesize_reljump
from qprobe.arch.x86_64.ptregs import (
    PT_GPRS,
    PT_REGS_SIZE,
    STUB_FRAME_FLAGS,
    STUB_FRAME_ID,
    STUB_FRAME_RET,
    STUB_FRAME_SIZE,
    STUB_FRAME_SP,
)

# The frame's layout is defined with pt_regs in qprobe.arch.x86_64.ptregs.
FRAME_REGS = PT_GPRS  # the general registers, in the frame's (pt_regs') order
FRAME_FLAGS = STUB_FRAME_FLAGS
FRAME_SP = STUB_FRAME_SP
FRAME_RET = STUB_FRAME_RET
FRAME_ID = STUB_FRAME_ID
FRAME_SIZE = STUB_FRAME_SIZE  # the probed context's rsp is frame + FRAME_SIZE

# Mailbox layout (one per CPU, MAILBOX_SIZE bytes)
MB_STATE, MB_BUSY, MB_FRAME, MB_CR3, MB_PERCPU, MB_CURRENT, MB_FINAL_IP, MB_FINAL_SP, MB_TSC = (
    0x00, 0x08, 0x18, 0x20, 0x28, 0x30, 0x38, 0x40, 0x48)  # fmt: skip
MB_REGS = 0x80  # the frame, copied (FRAME_SIZE bytes)
MAILBOX_SHIFT = 9
MAILBOX_SIZE = 1 << MAILBOX_SHIFT
STATE_IDLE, STATE_REQUEST, STATE_DONE = 0, 1, 2
DETOUR_HEAD = 10  # push imm32 (5) + call rel32 (5)

_PUSHED = tuple(reversed(PT_GPRS))  # pushed in this order, they lie in pt_regs'
_SKIPPED = FRAME_FLAGS - 8 * len(PT_GPRS)  # orig_ax, ip and cs: between the registers and flags


@dataclass(frozen=True)
class StubParams:
    mailboxes: int  # address of CPU 0's mailbox
    missed: int  # address of the per-probe nmissed counters (u64 each)
    cpu_number: int  # per-CPU offset of cpu_number
    this_cpu_off: int  # per-CPU offset of this_cpu_off (the CPU's per-CPU base)
    current_task: int  # per-CPU offset of current_task
    port: int  # the isa-debugcon I/O port


def _r(name: str) -> RegisterKind:
    reg: RegisterKind = getattr(Register, name.upper())
    return reg


def _mem(
    base: str | None = None, disp: int = 0, index: str | None = None, scale: int = 1, seg: str | None = None
) -> MemoryOperand:
    if disp >= 1 << 63:
        disp -= 1 << 64  # a kernel-image address, encoded as a sign-extended disp32
    if not -(1 << 31) <= disp < 1 << 31:
        raise ValueError(f"displacement {disp:#x} does not fit 32 bits")
    return MemoryOperand(_r(base) if base else Register.NONE, _r(index) if index else Register.NONE, scale,
                         disp, 8 if disp else 0, False, _r(seg) if seg else Register.NONE)  # fmt: skip


def simm32(v: int) -> int:
    """A kernel address (top 2 GiB) as the sign-extended imm32 an instruction carries."""
    return v - (1 << 64) if v >> 63 else v


def locked_inc(addr: int) -> Instruction:
    """``lock inc qword [addr]``, the address as an absolute disp32."""
    insn = Instruction.create_mem(Code.INC_RM64, _mem(disp=addr))
    insn.has_lock_prefix = True
    return insn


def save_regs(*names: str) -> list[Instruction]:
    """``pushfq; cli; push <names>``: the start of an in-guest action that runs with interrupts off."""
    return [Instruction.create(Code.PUSHFQ), Instruction.create(Code.CLI),
            *(Instruction.create_reg(Code.PUSH_R64, _r(n)) for n in names)]  # fmt: skip


def restore_regs(*names: str, label: int = 0) -> list[Instruction]:
    """The end of what ``save_regs(*names)`` started: ``pop`` them in reverse, ``popfq``; ``label`` names the first."""
    out = [*(Instruction.create_reg(Code.POP_R64, _r(n)) for n in reversed(names)), Instruction.create(Code.POPFQ)]
    out[0].ip = label
    return out


def _ring_then_spin(port: int, spin: int) -> list[Instruction]:
    """``out`` AL to the doorbell ``port``, then the ``pause`` that heads a wait loop (labelled ``spin``)."""
    c = Instruction
    pause = c.create(Code.PAUSE)
    pause.ip = spin
    return [c.create_reg_u32(Code.MOV_R32_IMM32, Register.EDX, port),
            c.create_reg_reg(Code.OUT_DX_AL, Register.DX, Register.AL), pause]  # fmt: skip


def save_pt_regs() -> list[Instruction]:
    """A stub's prologue: its frame, a struct pt_regs, at rsp; interrupts off, the direction flag clear.

    Entered by ``push id; call stub``: ``push rsp`` stores the sp slot (the stub's rsp, which the
    last instruction moves past the two pushes to the probed context's), ``pushfq`` the flags.
    """
    c = Instruction
    return [
        c.create_reg(Code.PUSH_R64, Register.RSP),
        c.create(Code.PUSHFQ),
        c.create(Code.CLI),
        c.create(Code.CLD),
        c.create_reg_mem(Code.LEA_R64_M, Register.RSP, _mem("rsp", -_SKIPPED)),
        *(c.create_reg(Code.PUSH_R64, _r(n)) for n in _PUSHED),
        c.create_mem_i32(Code.ADD_RM64_IMM8, _mem("rsp", FRAME_SP), FRAME_SIZE - FRAME_RET),
    ]


def restore_pt_regs(label: int) -> list[Instruction]:
    """The registers and flags back from the frame (``label`` names the first); rsp is left at the sp slot."""
    c = Instruction
    pops = [c.create_reg(Code.POP_R64, _r(n)) for n in reversed(_PUSHED)]
    pops[0].ip = label
    return [*pops, c.create_reg_mem(Code.LEA_R64_M, Register.RSP, _mem("rsp", _SKIPPED)), c.create(Code.POPFQ)]


def encode_detour(head: list[Instruction], address: int, relocated: bytes, resume: int) -> tuple[bytes, int]:
    """``head`` encoded at ``address``, then the relocated instructions and ``jmp resume``; and the head's length."""
    enc = BlockEncoder(64)
    enc.add_many(head)
    code = bytes(enc.encode(address))
    return code + relocated + synthesize_reljump(address + len(code) + len(relocated), resume), len(code)


def build_stub(p: StubParams, address: int) -> bytes:
    """The shared stub, encoded for ``address``."""
    spin, missed, restore = 1, 2, 3  # labels (BlockEncoder resolves branches by ip)
    c = Instruction
    code = save_pt_regs()
    code += [
        c.create_reg_mem(Code.MOV_R32_RM32, Register.EAX, _mem(disp=p.cpu_number, seg="gs")),
        c.create_reg_i32(Code.SHL_RM32_IMM8, Register.EAX, MAILBOX_SHIFT),
        c.create_reg_mem(Code.LEA_R64_M, Register.RBX, _mem("rax", p.mailboxes)),
        c.create_mem_i32(Code.CMP_RM64_IMM8, _mem("rbx", MB_BUSY), 0),
        c.create_branch(Code.JNE_REL32_64, missed),
        c.create_mem_i32(Code.MOV_RM64_IMM32, _mem("rbx", MB_BUSY), 1),
        c.create_mem_reg(Code.MOV_RM64_R64, _mem("rbx", MB_FRAME), Register.RSP),
        c.create_reg_reg(Code.MOV_R64_CR, Register.RAX, Register.CR3),
        c.create_mem_reg(Code.MOV_RM64_R64, _mem("rbx", MB_CR3), Register.RAX),
        c.create_reg_mem(Code.MOV_R64_RM64, Register.RAX, _mem(disp=p.this_cpu_off, seg="gs")),
        c.create_mem_reg(Code.MOV_RM64_R64, _mem("rbx", MB_PERCPU), Register.RAX),
        c.create_reg_mem(Code.MOV_R64_RM64, Register.RAX, _mem(disp=p.current_task, seg="gs")),
        c.create_mem_reg(Code.MOV_RM64_R64, _mem("rbx", MB_CURRENT), Register.RAX),
        # When the hit happened, on the clock the guest's own trace reads (rax and rdx are saved).
        c.create(Code.RDTSC),
        c.create_reg_i32(Code.SHL_RM64_IMM8, Register.RDX, 32),
        c.create_reg_reg(Code.OR_R64_RM64, Register.RAX, Register.RDX),
        c.create_mem_reg(Code.MOV_RM64_R64, _mem("rbx", MB_TSC), Register.RAX),
        c.create_reg_reg(Code.MOV_R64_RM64, Register.RSI, Register.RSP),
        c.create_reg_mem(Code.LEA_R64_M, Register.RDI, _mem("rbx", MB_REGS)),
        c.create_reg_u32(Code.MOV_R32_IMM32, Register.ECX, FRAME_SIZE // 8),
        c.create_movsq(64, Register.NONE, RepPrefixKind.REPE),
        # The request is published last; x86 stores are not reordered with older stores.
        c.create_mem_i32(Code.MOV_RM64_IMM32, _mem("rbx", MB_STATE), STATE_REQUEST),
        c.create_reg_mem(Code.MOV_R32_RM32, Register.EAX, _mem(disp=p.cpu_number, seg="gs")),
        *_ring_then_spin(p.port, spin),
        c.create_mem_i32(Code.CMP_RM64_IMM8, _mem("rbx", MB_STATE), STATE_DONE),
        c.create_branch(Code.JNE_REL32_64, spin),
        # Registers and flags back from the mailbox: the handlers may have changed them.
        c.create_reg_mem(Code.LEA_R64_M, Register.RSI, _mem("rbx", MB_REGS)),
        c.create_reg_reg(Code.MOV_R64_RM64, Register.RDI, Register.RSP),
        c.create_reg_u32(Code.MOV_R32_IMM32, Register.ECX, FRAME_RET // 8),
        c.create_movsq(64, Register.NONE, RepPrefixKind.REPE),
        # Resume at FINAL_IP with rsp = FINAL_SP: store the ip just below the new
        # stack pointer and point the frame's sp slot at it for `pop rsp; ret`.
        c.create_reg_mem(Code.MOV_R64_RM64, Register.RCX, _mem("rbx", MB_FINAL_SP)),
        c.create_reg_mem(Code.MOV_R64_RM64, Register.RAX, _mem("rbx", MB_FINAL_IP)),
        c.create_reg_i32(Code.SUB_RM64_IMM8, Register.RCX, 8),
        c.create_mem_reg(Code.MOV_RM64_R64, _mem("rcx"), Register.RAX),
        c.create_mem_reg(Code.MOV_RM64_R64, _mem("rsp", FRAME_SP), Register.RCX),
        c.create_mem_i32(Code.MOV_RM64_IMM32, _mem("rbx", MB_STATE), STATE_IDLE),
        c.create_mem_i32(Code.MOV_RM64_IMM32, _mem("rbx", MB_BUSY), 0),
        c.create_branch(Code.JMP_REL32_64, restore),
    ]
    first_missed = c.create_reg_mem(Code.MOV_R64_RM64, Register.RAX, _mem("rsp", FRAME_ID))
    first_missed.ip = missed
    inc = c.create_mem(Code.INC_RM64, _mem(None, p.missed, "rax", 8))
    inc.has_lock_prefix = True
    code += [
        first_missed,
        inc,
        # Resume at the detour's continue label (its call's return address), rsp unchanged.
        c.create_reg_mem(Code.MOV_R64_RM64, Register.RAX, _mem("rsp", FRAME_RET)),
        c.create_mem_reg(Code.MOV_RM64_R64, _mem("rsp", FRAME_ID), Register.RAX),
        c.create_reg_mem(Code.LEA_R64_M, Register.RAX, _mem("rsp", FRAME_ID)),
        c.create_mem_reg(Code.MOV_RM64_R64, _mem("rsp", FRAME_SP), Register.RAX),
    ]
    code += [*restore_pt_regs(restore), c.create_reg(Code.POP_R64, Register.RSP), c.create(Code.RETNQ)]
    enc = BlockEncoder(64)
    enc.add_many(code)
    return bytes(enc.encode(address))


def count_head(counter: int) -> bytes:
    """``pushfq; lock inc qword [counter]; popfq``: an in-guest count that wakes nobody.

    ``counter`` is a kernel address, encoded as an absolute sign-extended disp32
    (no base, no rip): the bytes do not depend on where they are placed.
    """
    enc = BlockEncoder(64)
    enc.add_many([Instruction.create(Code.PUSHFQ), locked_inc(counter), Instruction.create(Code.POPFQ)])
    return bytes(enc.encode(0))


COUNT_HEAD = len(count_head(-(1 << 31) & ((1 << 64) - 1)))


def build_count_detour(address: int, counter: int, relocated: bytes, resume: int) -> bytes:
    """``<count_head>; <the replaced instructions, relocated>; jmp resume`` encoded at ``address``."""
    return count_head(counter) + relocated + synthesize_reljump(address + COUNT_HEAD + len(relocated), resume)


def build_detour(address: int, probe_id: int, stub: int, relocated: bytes, resume: int) -> bytes:
    """``push id; call stub; <relocated>; jmp resume`` encoded at ``address``."""
    if not 0 <= probe_id < 1 << 31:
        raise ValueError(f"probe id {probe_id} does not fit a push imm32")
    head = bytes([0x68]) + probe_id.to_bytes(4, "little") + synthesize_relcall(address + 5, stub)
    tail_at = address + DETOUR_HEAD + len(relocated)
    return head + relocated + synthesize_reljump(tail_at, resume)


# -- in-guest records: a per-CPU ring the host drains from the RAM file ----------------
# 4096 entries (1 MiB) per CPU unless the host asks for another power of two: a burst that long is held
# without its vCPU waiting, as ftrace's per-CPU buffer (buffer_size_kb, 1.4 MB by default) holds one.
RING_SHIFT = 12
RING_ENTRIES = 1 << RING_SHIFT
ENTRY_SHIFT = 8
ENTRY_SIZE = 1 << ENTRY_SHIFT
RING_HEADER = 64  # per CPU: head (written by the guest), tail (by the host)
# head and waits are the guest's to write, tail and lossy the host's: waits counts the records that found
# the ring full and waited for the host to drain it; lossy (non-zero) drops them instead, counted as lost.
R_HEAD, R_TAIL, R_WAITS, R_LOSSY = 0x00, 0x08, 0x10, 0x18
# A full ring's record waits at most this many pause loops (a second or two under TCG) for the host, then
# is dropped as lost: a guest whose host is gone is slowed, never hung.
SPIN_LIMIT = 1 << 24
# The doorbell byte that asks the host to drain the rings now (a CPU number is a mailbox's).
DRAIN_DOORBELL = 0xFF
# An entry: the stub's frame (a pt_regs, the probe id after it), then what the host cannot read later.
E_TSC, E_CPU_PID, E_COMM, E_TASK = FRAME_SIZE, FRAME_SIZE + 8, FRAME_SIZE + 16, FRAME_SIZE + 32
# A uprobe handler's entry is the user pt_regs whole (its ip and cs included, which a detour's leaves as they
# were), and for a return the probed function's address, which a detour's entry leaves as it was.
E_FUNC = E_TASK + 8
PT_REGS_WORDS = PT_REGS_SIZE // 8
assert E_FUNC + 8 <= ENTRY_SIZE and MB_REGS + FRAME_SIZE <= MAILBOX_SIZE


def task_comm(raw: bytes) -> str:
    """A task's 16-byte ``comm`` as a record or a map key carries it, as text (ends at its NUL)."""
    return raw[:16].split(b"\0")[0].decode(errors="replace")


def task_pid(word: int) -> int:
    """A task's ``pid`` (an s32) from the word a record or a map key carries it in, its low 32 bits."""
    pid = word & 0xFFFFFFFF
    return pid - (1 << 32) if pid >> 31 else pid


@dataclass(frozen=True)
class RecordParams:
    headers: int  # CPU 0's ring header; CPU n's is RING_HEADER * n further
    data: int  # CPU 0's entries; CPU n's are entries * ENTRY_SIZE * n further
    entries: int  # per CPU, a power of two
    lost: int  # per-probe counters of records dropped on a full ring (u64 each)
    cpu_number: int  # per-CPU offset of cpu_number
    current_task: int  # per-CPU offset of current_task
    pid_offset: int  # offsetof(struct task_struct, pid)
    comm_offset: int  # offsetof(struct task_struct, comm)
    port: int  # the isa-debugcon I/O port: DRAIN_DOORBELL there asks the host to drain now


def build_record_stub(p: RecordParams, address: int) -> bytes:
    """The shared record stub: snapshot the registers into this CPU's ring and return.

    Called like the mailbox stub (``push id; call stub``), it leaves through
    ``ret 8`` to the detour's continue label.  A full ring makes the record
    wait (interrupts off, as the whole stub runs) until the host has drained
    it, ringing the doorbell once to ask for that at once; the ring's
    ``waits`` counts such records.  With the ring's ``lossy`` set, or after
    SPIN_LIMIT pause loops, the record is dropped instead and counted as lost
    for its probe.  The hit's time is read before any wait.
    """
    c = Instruction
    done = 1
    source = [c.create_reg_reg(Code.MOV_R64_RM64, Register.RSI, Register.RSP)]
    lost_id = c.create_reg_mem(Code.MOV_R64_RM64, Register.RAX, _mem("rsp", FRAME_ID))
    code = [*save_pt_regs(), *_append_record(p, source, FRAME_SIZE // 8, [], lost_id)]
    # Past the sp slot without touching the flags just restored, then to the continue label.
    code += [*restore_pt_regs(done), c.create_reg_mem(Code.LEA_R64_M, Register.RSP, _mem("rsp", 8)),
             c.create_i32(Code.RETNQ_IMM16, 8)]  # fmt: skip
    enc = BlockEncoder(64)
    enc.add_many(code)
    return bytes(enc.encode(address))


def build_record_handler(p: RecordParams, probe_id: int, counter: int, returns: bool, address: int) -> bytes:
    """A ``struct uprobe_consumer`` handler that records the hit's user registers into this CPU's ring.

    Called by the kernel's uprobes as ``handler(self, regs)``, or for a
    return as ``ret_handler(self, func, regs)``: it counts the hit at
    ``counter``, copies ``*regs`` (the user context, its ip the probed
    address, or the return address) into an entry as the record stub's
    frame would lie, with ``probe_id`` and, for a return, ``func`` (E_FUNC),
    and returns 0.  Interrupts are off while it writes (the ring is per CPU);
    a full ring waits or drops as the record stub's does.
    """
    c = Instruction
    done, kept = 1, ("rbx", "r12", "r13", "r14")  # callee-saved ones the record uses, and its two arguments
    code = [c.create(Code.ENDBR64), *save_regs(*kept),
            c.create_reg_reg(Code.MOV_R64_RM64, Register.R13, Register.RDX if returns else Register.RSI),
            c.create_reg_reg(Code.MOV_R64_RM64, Register.R14, Register.RSI) if returns else
            c.create_reg_reg(Code.XOR_R32_RM32, Register.R14D, Register.R14D),
            locked_inc(counter)]  # fmt: skip
    fill = [
        c.create_mem_i32(Code.MOV_RM64_IMM32, _mem("rdi", FRAME_ID), probe_id),
        c.create_mem_reg(Code.MOV_RM64_R64, _mem("rdi", E_FUNC), Register.R14),
    ]
    source = [c.create_reg_reg(Code.MOV_R64_RM64, Register.RSI, Register.R13)]
    lost_id = c.create_reg_u32(Code.MOV_R32_IMM32, Register.EAX, probe_id)
    code += _append_record(p, source, PT_REGS_WORDS, fill, lost_id)
    code += [*restore_regs(*kept, label=done), c.create_reg_reg(Code.XOR_R32_RM32, Register.EAX, Register.EAX),
             c.create(Code.RETNQ)]  # fmt: skip
    enc = BlockEncoder(64)
    enc.add_many(code)
    return bytes(enc.encode(address))


def _append_record(p: RecordParams, source: list[Instruction], words: int, fill: list[Instruction],
                   lost_id: Instruction) -> list[Instruction]:  # fmt: skip
    """Append one entry to this CPU's ring, interrupts off: ``words`` u64s copied from where ``source`` points rsi,
    then ``fill`` (rdi at the entry), then the time, CPU, pid, comm and task; a record dropped on a full ring is
    counted for the probe id ``lost_id`` puts in rax.  Ends by going to label 1, which the caller places next.

    Uses rax, rbx, rcx, rdx, rsi, rdi and r8 to r12; the direction flag must be clear.
    """
    if p.entries <= 0 or p.entries & (p.entries - 1) or p.entries * ENTRY_SIZE > 1 << 31:
        raise ValueError(f"a ring of {p.entries} entries: a power of two, of at most 2 GiB, is needed")
    ring_shift = p.entries.bit_length() - 1
    done, full, check, space, spin = 1, 2, 3, 4, 5
    c = Instruction
    code = [
        c.create(Code.RDTSC),
        c.create_reg_i32(Code.SHL_RM64_IMM8, Register.RDX, 32),
        c.create_reg_reg(Code.OR_R64_RM64, Register.RAX, Register.RDX),
        c.create_reg_reg(Code.MOV_R64_RM64, Register.R11, Register.RAX),
        c.create_reg_mem(Code.MOV_R32_RM32, Register.R8D, _mem(disp=p.cpu_number, seg="gs")),
        c.create_reg_reg(Code.MOV_R32_RM32, Register.EAX, Register.R8D),
        c.create_reg_i32(Code.SHL_RM32_IMM8, Register.EAX, 6),
        c.create_reg_mem(Code.LEA_R64_M, Register.RBX, _mem("rax", p.headers)),
        c.create_reg_u32(Code.MOV_R32_IMM32, Register.R10D, SPIN_LIMIT),
        c.create_reg_reg(Code.XOR_R32_RM32, Register.R12D, Register.R12D),  # the doorbell not rung yet
    ]
    head = c.create_reg_mem(Code.MOV_R64_RM64, Register.RAX, _mem("rbx", R_HEAD))
    head.ip = check
    code += [
        head,
        c.create_reg_reg(Code.MOV_R64_RM64, Register.RCX, Register.RAX),
        c.create_reg_mem(Code.SUB_R64_RM64, Register.RCX, _mem("rbx", R_TAIL)),
        c.create_reg_i32(Code.CMP_RM64_IMM32, Register.RCX, p.entries),
        c.create_branch(Code.JB_REL32_64, space),
        c.create_mem_i32(Code.CMP_RM64_IMM8, _mem("rbx", R_LOSSY), 0),
        c.create_branch(Code.JNE_REL32_64, full),
        c.create_reg_reg(Code.TEST_RM32_R32, Register.R12D, Register.R12D),
        c.create_branch(Code.JNE_REL32_64, spin),
        c.create_mem(Code.INC_RM64, _mem("rbx", R_WAITS)),
        c.create_reg_u32(Code.MOV_R32_IMM32, Register.R12D, 1),
        c.create_reg_u32(Code.MOV_R32_IMM32, Register.EAX, DRAIN_DOORBELL),
        *_ring_then_spin(p.port, spin),
        c.create_reg(Code.DEC_RM64, Register.R10),
        c.create_branch(Code.JE_REL32_64, full),
        c.create_branch(Code.JMP_REL32_64, check),
    ]
    slot = c.create_reg_i32(Code.AND_RM32_IMM32, Register.EAX, p.entries - 1)
    slot.ip = space
    code += [
        slot,
        c.create_reg_i32(Code.SHL_RM32_IMM8, Register.EAX, ENTRY_SHIFT),
        c.create_reg_reg(Code.MOV_R32_RM32, Register.R9D, Register.R8D),
        c.create_reg_i32(Code.SHL_RM64_IMM8, Register.R9, ring_shift + ENTRY_SHIFT),
        c.create_reg_mem(Code.LEA_R64_M, Register.RDI, _mem("rax", p.data, "r9")),
        *source,
        c.create_reg_u32(Code.MOV_R32_IMM32, Register.ECX, words),
        c.create_movsq(64, Register.NONE, RepPrefixKind.REPE),
        c.create_reg_mem(Code.LEA_R64_M, Register.RDI, _mem("rdi", -8 * words)),
        *fill,
        c.create_mem_reg(Code.MOV_RM64_R64, _mem("rdi", E_TSC), Register.R11),
        c.create_reg_mem(Code.MOV_R64_RM64, Register.RAX, _mem(disp=p.current_task, seg="gs")),
        c.create_mem_reg(Code.MOV_RM64_R64, _mem("rdi", E_TASK), Register.RAX),
        c.create_reg_mem(Code.MOV_R32_RM32, Register.ECX, _mem("rax", p.pid_offset)),
        c.create_reg_i32(Code.SHL_RM64_IMM8, Register.RCX, 32),
        c.create_reg_reg(Code.OR_R64_RM64, Register.RCX, Register.R8),
        c.create_mem_reg(Code.MOV_RM64_R64, _mem("rdi", E_CPU_PID), Register.RCX),
        c.create_reg_mem(Code.MOV_R64_RM64, Register.RCX, _mem("rax", p.comm_offset)),
        c.create_mem_reg(Code.MOV_RM64_R64, _mem("rdi", E_COMM), Register.RCX),
        c.create_reg_mem(Code.MOV_R64_RM64, Register.RCX, _mem("rax", p.comm_offset + 8)),
        c.create_mem_reg(Code.MOV_RM64_R64, _mem("rdi", E_COMM + 8), Register.RCX),
        # Published last; x86 stores are not reordered with older stores, and only this CPU writes head.
        c.create_mem(Code.INC_RM64, _mem("rbx", R_HEAD)),
        c.create_branch(Code.JMP_REL32_64, done),
    ]
    lost_id.ip = full
    inc = c.create_mem(Code.INC_RM64, _mem(None, p.lost, "rax", 8))
    inc.has_lock_prefix = True
    return [*code, lost_id, inc]
