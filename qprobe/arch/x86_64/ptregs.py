"""``struct pt_regs`` on x86_64, defined once; every register table qprobe uses is derived from it.

The layout is arch/x86/include/asm/ptrace.h's (the ptrace ABI: it never
moves).  Each field has its pt_regs name (what handlers and kprobe_events
use: ``regs.ax``, ``%di``) and the gdbstub's name for the register (``rax``,
``rdi``, what QEMU's ``g`` packet and qprobe's register dicts use).  Readers
of a pt_regs in guest memory (the #BP handler's frame, a hardware exception
frame, the optimized stub's frame in a mailbox or a record ring) go through
:func:`parse_pt_regs`, :func:`parse_hw_frame` and :func:`parse_stub_frame`.
"""

from __future__ import annotations

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
X86_EFLAGS_TF = 1 << 8  # trap flag (single-step)
X86_EFLAGS_IF = 1 << 9  # interrupts enabled
X86_EFLAGS_RF = 1 << 16  # resume flag (suppresses an instruction breakpoint once)
KERNEL_CS, KERNEL_DS = 0x10, 0x18  # GDT_ENTRY_KERNEL_CS * 8, GDT_ENTRY_KERNEL_DS * 8

# The optimized-probe stub's frame (qprobe.arch.x86_64.detour): the general registers as its
# pushes leave them, then flags, the return into the detour and the probe id.  Its own order
# (not pt_regs') because the stubs push in this order; the words are named from pt_regs above.
STUB_FRAME_GPRS = ("r15", "r14", "r13", "r12", "r11", "r10", "r9", "r8", "rdi", "rsi", "rbp", "rbx", "rdx", "rcx",
                   "rax")  # fmt: skip
assert sorted(STUB_FRAME_GPRS) == sorted(PT_GPRS)
STUB_FRAME_FLAGS = 8 * len(STUB_FRAME_GPRS)
STUB_FRAME_RET = STUB_FRAME_FLAGS + 8
STUB_FRAME_ID = STUB_FRAME_RET + 8
STUB_FRAME_SIZE = STUB_FRAME_ID + 8  # the probed context's rsp is frame + STUB_FRAME_SIZE


def parse_pt_regs(raw: bytes) -> dict[str, int]:
    """A struct pt_regs read from guest memory, by field (gdb's register names)."""
    return dict(zip(PT_REGS_ORDER, struct.unpack(f"<{len(PT_REGS_ORDER)}Q", raw[:PT_REGS_SIZE]), strict=True))


def parse_hw_frame(raw: bytes) -> dict[str, int]:
    """The hardware exception frame (rip, cs, eflags, rsp, ss) at the stack pointer of an exception entry."""
    return dict(zip(HW_FRAME, struct.unpack(f"<{len(HW_FRAME)}Q", raw[:HW_FRAME_SIZE]), strict=True))


def parse_stub_frame(raw: bytes) -> tuple[dict[str, int], int, int]:
    """An optimized stub's frame: (registers by gdb name with ``eflags``, return into the detour, probe id)."""
    words = struct.unpack(f"<{STUB_FRAME_SIZE // 8}Q", raw[:STUB_FRAME_SIZE])
    values = dict(zip(STUB_FRAME_GPRS, words, strict=False))
    values["eflags"] = words[STUB_FRAME_FLAGS // 8]
    return values, words[STUB_FRAME_RET // 8], words[STUB_FRAME_ID // 8]


def stub_frame_offset(gdb_name: str) -> int | None:
    """Where register ``gdb_name`` lives in a stub frame (None: not saved there)."""
    if gdb_name == "eflags":
        return STUB_FRAME_FLAGS
    return 8 * STUB_FRAME_GPRS.index(gdb_name) if gdb_name in STUB_FRAME_GPRS else None


__all__ = [
    "ARG_REGS",
    "FRAME_OFFSET",
    "GDB_NAME",
    "HW_FRAME",
    "HW_FRAME_SIZE",
    "KERNEL_CS",
    "KERNEL_DS",
    "PT_GPRS",
    "PT_NAME",
    "PT_NAMES",
    "PT_REGS_LAYOUT",
    "PT_REGS_ORDER",
    "PT_REGS_SIZE",
    "STUB_FRAME_FLAGS",
    "STUB_FRAME_GPRS",
    "STUB_FRAME_ID",
    "STUB_FRAME_RET",
    "STUB_FRAME_SIZE",
    "X86_EFLAGS_IF",
    "X86_EFLAGS_RF",
    "X86_EFLAGS_TF",
    "parse_hw_frame",
    "parse_pt_regs",
    "parse_stub_frame",
    "stub_frame_offset",
]
