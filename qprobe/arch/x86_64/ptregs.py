"""``struct pt_regs`` on x86_64, defined once; every register table qprobe uses is derived from it.

The layout is arch/x86/include/asm/ptrace.h's (the ptrace ABI: it never
moves).  Each field has its pt_regs name (what handlers and kprobe_events
use: ``regs.ax``, ``%di``) and the gdbstub's name for the register (``rax``,
``rdi``, what QEMU's ``g`` packet and qprobe's register dicts use).  A
pt_regs in guest memory is read by :func:`parse_pt_regs`, whoever wrote it:
the #BP handler's frame, or an optimized probe's stub, whose frame in a
mailbox or a record ring is a pt_regs too (:func:`parse_stub_frame` adds the
two words after it); the hardware exception frame is its tail
(:func:`parse_hw_frame`).
"""

from __future__ import annotations

import operator
import struct

# (pt_regs name, gdb name) in memory order; the last five are the hardware exception frame.
PT_REGS_LAYOUT: tuple[tuple[str, str], ...] = (
    ("r15", "r15"), ("r14", "r14"), ("r13", "r13"), ("r12", "r12"), ("bp", "rbp"), ("bx", "rbx"),
    ("r11", "r11"), ("r10", "r10"), ("r9", "r9"), ("r8", "r8"), ("ax", "rax"), ("cx", "rcx"),
    ("dx", "rdx"), ("si", "rsi"), ("di", "rdi"), ("orig_ax", "orig_ax"),
    ("ip", "rip"), ("cs", "cs"), ("flags", "eflags"), ("sp", "rsp"), ("ss", "ss"),
)  # fmt: skip
PT_NAMES = tuple(pt for pt, _ in PT_REGS_LAYOUT)  # pt_regs field names, in memory order
PT_REGS_ORDER = tuple(g for _, g in PT_REGS_LAYOUT)  # the same fields by gdb name
PT_REGS_SIZE = 8 * len(PT_REGS_LAYOUT)
PT_GPRS = PT_REGS_ORDER[: PT_REGS_ORDER.index("orig_ax")]  # the general registers (gdb names)
# pt_regs name -> gdb name, for the registers a handler may read and write (orig_ax is not a register).
GDB_NAME = {pt: g for pt, g in PT_REGS_LAYOUT if pt != "orig_ax"}
PT_NAME = {g: pt for pt, g in GDB_NAME.items()}
HW_FRAME = PT_REGS_ORDER[PT_REGS_ORDER.index("rip") :]  # what the CPU pushes on an exception: rip cs eflags rsp ss
HW_FRAME_SIZE = 8 * len(HW_FRAME)
FRAME_OFFSET = 8 * PT_REGS_ORDER.index("rip")  # where the hardware frame starts in pt_regs

# The x86_64 calling convention's integer argument registers (pt_regs names), in order.
ARG_REGS = ("di", "si", "dx", "cx", "r8", "r9")
# The flags' bits (arch/x86/include/uapi/asm/processor-flags.h).
X86_EFLAGS_CF = 1 << 0  # carry
X86_EFLAGS_PF = 1 << 2  # parity
X86_EFLAGS_ZF = 1 << 6  # zero
X86_EFLAGS_SF = 1 << 7  # sign
X86_EFLAGS_TF = 1 << 8  # trap flag (single-step)
X86_EFLAGS_IF = 1 << 9  # interrupts enabled
X86_EFLAGS_OF = 1 << 11  # overflow
X86_EFLAGS_RF = 1 << 16  # resume flag (suppresses an instruction breakpoint once)
KERNEL_CS, KERNEL_DS = 0x10, 0x18  # GDT_ENTRY_KERNEL_CS * 8, GDT_ENTRY_KERNEL_DS * 8

# The optimized-probe stub's frame (qprobe.arch.x86_64.detour) is a struct pt_regs, as the
# kernel's optprobe trampoline builds one: the general registers, orig_ax, ip and cs (not
# written: the host knows the probe's ip and a kernel-mode cs), flags and the probed context's
# sp.  Like the kernel's trampoline it does not save ss: that word is the return into the detour
# its ``call`` pushed, and the probe id its ``push`` left follows the pt_regs.
STUB_FRAME_FLAGS = 8 * PT_REGS_ORDER.index("eflags")
STUB_FRAME_SP = 8 * PT_REGS_ORDER.index("rsp")
STUB_FRAME_RET = 8 * PT_REGS_ORDER.index("ss")
STUB_FRAME_ID = PT_REGS_SIZE
STUB_FRAME_SIZE = STUB_FRAME_ID + 8  # the probed context's rsp is frame + STUB_FRAME_SIZE
# What a stub's frame holds of the probed context (gdb names): its general registers, flags and sp.
STUB_FRAME_REGS = (*PT_GPRS, "eflags", "rsp")


# Parsed on every optimized hit and every ring record: the formats are compiled once, and a stub
# frame's registers are picked from the words by index rather than through a dict of all of them.
_PT_REGS = struct.Struct(f"<{len(PT_REGS_ORDER)}Q")
_STUB_FRAME = struct.Struct(f"<{STUB_FRAME_SIZE // 8}Q")
_STUB_FRAME_PICK = operator.itemgetter(*(PT_REGS_ORDER.index(g) for g in STUB_FRAME_REGS))
_STUB_FRAME_RET_WORD, _STUB_FRAME_ID_WORD = STUB_FRAME_RET // 8, STUB_FRAME_ID // 8


def parse_pt_regs(raw: bytes) -> dict[str, int]:
    """A struct pt_regs read from guest memory, by field (gdb's register names)."""
    return dict(zip(PT_REGS_ORDER, _PT_REGS.unpack_from(raw), strict=True))


def parse_hw_frame(raw: bytes) -> dict[str, int]:
    """The hardware exception frame (rip, cs, eflags, rsp, ss) at the stack pointer of an exception entry."""
    return dict(zip(HW_FRAME, struct.unpack(f"<{len(HW_FRAME)}Q", raw[:HW_FRAME_SIZE]), strict=True))


def parse_stub_frame(raw: bytes, offset: int = 0) -> tuple[dict[str, int], int, int]:
    """An optimized stub's frame at ``offset`` in ``raw``: (the context's registers by gdb name, return into
    the detour, probe id)."""
    words = _STUB_FRAME.unpack_from(raw, offset)
    values = dict(zip(STUB_FRAME_REGS, _STUB_FRAME_PICK(words), strict=True))
    return values, words[_STUB_FRAME_RET_WORD], words[_STUB_FRAME_ID_WORD]


def stub_frame_offset(gdb_name: str) -> int | None:
    """Where the stub reloads register ``gdb_name`` from (None: not there; sp and ip are the stub's exit's)."""
    return 8 * PT_REGS_ORDER.index(gdb_name) if gdb_name in STUB_FRAME_REGS and gdb_name != "rsp" else None


# The registers the shell prints for a vCPU, in QEMU's order (its target description's), each with
# how gdb shows its type there: rip a code pointer, rsp and rbp data pointers, eflags by flag.
DISPLAY = (*((g, "int") for g in ("rax", "rbx", "rcx", "rdx", "rsi", "rdi")), ("rbp", "data"), ("rsp", "data"),
           *((f"r{n}", "int") for n in range(8, 16)), ("rip", "code"), ("eflags", "flags"),
           *((g, "int") for g in ("cs", "ss", "ds", "es", "fs", "gs")),
           *((g, "hex") for g in ("fs_base", "gs_base", "k_gs_base")),
           *((g, "hex") for g in ("cr0", "cr2", "cr3", "cr4", "cr8", "efer")))  # fmt: skip
# The flags gdb names in EFLAGS (gdb's i386_eflags type), as masks.
FLAG_BITS = tuple((1 << bit, name) for bit, name in (
    (0, "CF"), (2, "PF"), (4, "AF"), (6, "ZF"), (7, "SF"), (8, "TF"), (9, "IF"), (10, "DF"), (11, "OF"), (14, "NT"),
    (16, "RF"), (17, "VM"), (18, "AC"), (19, "VIF"), (20, "VIP"), (21, "ID")))  # fmt: skip
# The registers a write changes nothing else with: the general ones, rip and eflags.  Writing a
# control register, even with its own value, has effects (a TLB flush on CR0/CR3/CR4).
PLAIN = frozenset((*PT_GPRS, "rip", "eflags", "rsp"))

__all__ = [
    "ARG_REGS",
    "DISPLAY",
    "FLAG_BITS",
    "FRAME_OFFSET",
    "GDB_NAME",
    "HW_FRAME",
    "HW_FRAME_SIZE",
    "KERNEL_CS",
    "KERNEL_DS",
    "PLAIN",
    "PT_GPRS",
    "PT_NAME",
    "PT_NAMES",
    "PT_REGS_LAYOUT",
    "PT_REGS_ORDER",
    "PT_REGS_SIZE",
    "STUB_FRAME_FLAGS",
    "STUB_FRAME_ID",
    "STUB_FRAME_REGS",
    "STUB_FRAME_RET",
    "STUB_FRAME_SIZE",
    "STUB_FRAME_SP",
    "X86_EFLAGS_CF",
    "X86_EFLAGS_IF",
    "X86_EFLAGS_OF",
    "X86_EFLAGS_PF",
    "X86_EFLAGS_RF",
    "X86_EFLAGS_SF",
    "X86_EFLAGS_TF",
    "X86_EFLAGS_ZF",
    "parse_hw_frame",
    "parse_pt_regs",
    "parse_stub_frame",
    "stub_frame_offset",
]
