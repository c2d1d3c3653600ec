"""The host-side ORC unwinder: hand-built tables and fake stacks, then the real vmlinux's tables.

The fake kernel below is a small vmlinux file written to tmp_path (so the
tables go through ``Symbols.file_bytes`` and the KASLR slide as in real use),
with one ORC entry per interesting instruction, packed here with ``struct``
from the 6.1 ``struct orc_entry`` layout spelled out again on purpose: if the
decoder mis-placed a bitfield, these tests would read the wrong rule.
"""

from __future__ import annotations

import bisect
import itertools
import struct
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from qprobe.errors import ImageError, SymbolError
from qprobe.kernel.orc import OrcEntry, OrcTable, OrcUnwinder, format_stack, return_fixer, unwinder_for
from qprobe.kernel.symbols import Section, Symbols
from qprobe.target.memory import MemoryFault

# ORC_REG_* and the 6.1 types, again.
UNDEF, PREV_SP, DX, DI, BP, SP, R10, R13, BP_IND, SP_IND = 0, 1, 2, 3, 4, 5, 6, 7, 8, 9
CALL, REGS, PARTIAL = 0, 1, 2

TEXT = 0xFFFF_FFFF_8100_0000  # link address of the fake .text
SLIDE = 0x1E0_0000  # KASLR: running = link + SLIDE
IP_TABLE = TEXT + 0x10_0000  # .orc_unwind_ip lies above the code: every s32 offset is negative
ORC_TABLE = IP_TABLE + 0x1000
USER_CS, KERNEL_CS = 0x33, 0x10
PT_FIELDS = ("r15", "r14", "r13", "r12", "bp", "bx", "r11", "r10", "r9", "r8", "ax", "cx", "dx", "si", "di",
             "orig_ax", "ip", "cs", "flags", "sp", "ss")  # fmt: skip
PT = {n: 8 * i for i, n in enumerate(PT_FIELDS)}


def orc(sp_offset: int, sp_reg: int, type_: int = CALL, bp_offset: int = 0, bp_reg: int = UNDEF, end: int = 0) -> bytes:
    return struct.pack("<hhH", sp_offset, bp_offset, sp_reg | bp_reg << 4 | type_ << 8 | end << 10)


def ip_table(base: int, ips: list[int]) -> bytes:
    """.orc_unwind_ip: entry i holds ip - (its own address)."""
    return b"".join(struct.pack("<i", ip - (base + 4 * i)) for i, ip in enumerate(ips))


# -- the fake kernel's code: function -> (link offset from TEXT, size), and its ORC rules --------------
FUNCS = {
    "leaf": (0x100, 0x40), "mid": (0x200, 0x40), "after_mid": (0x240, 0x40), "fp_func": (0x300, 0x40),
    "ind_func": (0x400, 0x40), "bpind_func": (0x500, 0x40), "r10_func": (0x600, 0x10), "r13_func": (0x610, 0x10),
    "di_func": (0x620, 0x10), "dx_func": (0x630, 0x10), "entry_regs": (0x700, 0x80), "entry_iret": (0x780, 0x80),
    "kthread_end": (0x800, 0x40), "rec": (0x840, 0x40), "backwards": (0x880, 0x40),
}  # fmt: skip
RULES = [  # (link offset, entry)
    (0x100, orc(8, SP)), (0x101, orc(16, SP)),  # leaf: entry, then after a push
    (0x200, orc(8, SP)), (0x204, orc(32, SP)),  # mid; its body calls leaf (returns to +0x20) and ends with a
    (0x240, orc(8, SP)),  # noreturn call, whose return address is after_mid's first byte
    (0x300, orc(8, SP)), (0x301, orc(16, SP, bp_offset=-16, bp_reg=PREV_SP)),  # push %rbp
    (0x304, orc(16, BP, bp_offset=-16, bp_reg=PREV_SP)),  # mov %rsp,%rbp: a frame-pointer function
    (0x400, orc(8, SP)), (0x410, orc(8, SP_IND)),  # on another stack: (%rsp) is the old sp
    (0x500, orc(8, SP)), (0x510, orc(-8, BP_IND)),  # DRAP: the old sp is at (%rbp - 8)
    (0x600, orc(0, R10)), (0x610, orc(0, R13)), (0x620, orc(0, DI)), (0x630, orc(0, DX)),
    (0x700, orc(0, SP, REGS)),  # pt_regs at sp (a syscall or an interrupt entry)
    (0x780, orc(0, SP, PARTIAL)),  # an iret frame at sp
    (0x800, orc(0, UNDEF, end=1)),  # ret_from_fork: the end of a kernel thread's stack
    (0x840, orc(16, SP)),
    (0x880, orc(-16, SP)),  # nonsense: the caller's frame below this one
    (0x900, orc(0, UNDEF)),  # the section terminator at the end of .text
]  # fmt: skip


def link(name: str, off: int = 0) -> int:
    return TEXT + FUNCS[name][0] + off


def run(name: str, off: int = 0) -> int:
    """The running (slid) address of name+off."""
    return link(name, off) + SLIDE


def build_symbols(path: Path, rules: list[tuple[int, bytes]] = RULES, *, with_orc: bool = True) -> Symbols:
    """A vmlinux-shaped file: .text, then .orc_unwind_ip and .orc_unwind at their file offsets."""
    ips = ip_table(IP_TABLE, [TEXT + off for off, _ in rules])
    entries = b"".join(e for _, e in rules)
    blob = bytearray(0x3000)
    blob[0x1000 : 0x1000 + len(ips)] = ips
    blob[0x2000 : 0x2000 + len(entries)] = entries
    path.write_bytes(bytes(blob))
    sections = [Section(".text", TEXT, 0x1000, 0, True)]
    if with_orc:
        sections += [Section(".orc_unwind_ip", IP_TABLE, len(ips), 0x1000, False),
                     Section(".orc_unwind", ORC_TABLE, len(entries), 0x2000, False)]  # fmt: skip
    syms = [(name, TEXT + off, size, "func") for name, (off, size) in FUNCS.items()]
    table = Symbols(path, "fake", syms, sections)
    table.slide = SLIDE
    return table


@pytest.fixture
def symbols(tmp_path: Path) -> Symbols:
    return build_symbols(tmp_path / "vmlinux")


@pytest.fixture
def unwinder(symbols: Symbols) -> OrcUnwinder:
    return OrcUnwinder(symbols)


class FakeStack:
    """Guest memory: 16 KiB stacks of u64 words; any other read faults."""

    def __init__(self, *bases: int) -> None:
        self.regions = {base: bytearray(0x4000) for base in bases}
        self.reads: list[tuple[int, int]] = []

    def put(self, addr: int, *values: int) -> None:
        for i, v in enumerate(values):
            base = self._region(addr + 8 * i, 8)
            self.regions[base][addr + 8 * i - base : addr + 8 * i - base + 8] = (v & (2**64 - 1)).to_bytes(8, "little")

    def pt_regs(self, addr: int, **fields: int) -> None:
        for name, value in fields.items():
            self.put(addr + PT[name], value)

    def _region(self, addr: int, n: int) -> int:
        for base in self.regions:
            if base <= addr and addr + n <= base + 0x4000:
                return base
        raise MemoryFault(addr)

    def read(self, addr: int, n: int) -> bytes:
        self.reads.append((addr, n))
        base = self._region(addr, n)
        return bytes(self.regions[base][addr - base : addr - base + n])


STACK = 0xFFFF_C900_0001_0000  # a task stack (16 KiB block)
IRQ_STACK = 0xFFFF_C900_0004_0000  # another stack, above it
S0 = STACK + 0x1000


def names(addrs: list[int]) -> list[str]:
    out = []
    for a in addrs:
        hit = next((f"{n}+{a - run(n):#x}" for n, (off, size) in FUNCS.items() if run(n) <= a < run(n) + size), None)
        out.append(hit or f"{a:#x}")
    return out


# -- entry decoding ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (orc(8, SP), OrcEntry(8, 0, SP, UNDEF, CALL, False)),
        (orc(16, BP, bp_offset=-16, bp_reg=PREV_SP), OrcEntry(16, -16, BP, PREV_SP, CALL, False)),
        (orc(0, SP, REGS), OrcEntry(0, 0, SP, UNDEF, REGS, False)),
        (orc(-32768, SP_IND, PARTIAL, 32767, BP), OrcEntry(-32768, 32767, SP_IND, BP, PARTIAL, False)),
        (orc(0, UNDEF, end=1), OrcEntry(0, 0, UNDEF, UNDEF, CALL, True)),
        # the raw words, to pin the bit positions: sp_reg 0-3, bp_reg 4-7, type 8-9, end 10
        (struct.pack("<hhH", 8, 0, 0x0015), OrcEntry(8, 0, SP, PREV_SP, CALL, False)),
        (struct.pack("<hhH", 0, 0, 0x0400), OrcEntry(0, 0, UNDEF, UNDEF, CALL, True)),
        (struct.pack("<hhH", 0, 0, 0x0209), OrcEntry(0, 0, SP_IND, UNDEF, PARTIAL, False)),
    ],
)
def test_entry_decoding(raw: bytes, expected: OrcEntry) -> None:
    assert OrcEntry.unpack(raw) == expected
    assert OrcEntry.unpack(b"\xaa" * 6 + raw, 6) == expected


def test_terminators_are_undefined_without_end() -> None:
    assert OrcEntry.unpack(orc(0, UNDEF)).terminator
    assert not OrcEntry.unpack(orc(0, UNDEF, end=1)).terminator
    assert not OrcEntry.unpack(orc(8, SP)).terminator


@pytest.mark.parametrize("bits", [0x0300, 0x0800, 0x1000, 0x8000])
def test_later_kernel_layouts_are_refused(bits: int) -> None:
    """6.3 moved end to bit 11, 6.4 made type 3 bits wide: neither may be misread as 6.1's."""
    entries = orc(8, SP) + struct.pack("<hhH", 8, 0, SP | bits)
    with pytest.raises(SymbolError, match="layout"):
        OrcTable(IP_TABLE, ip_table(IP_TABLE, [TEXT, TEXT + 4]), entries)


def test_mismatched_table_sizes_are_refused() -> None:
    with pytest.raises(SymbolError, match="bad ORC tables"):
        OrcTable(IP_TABLE, ip_table(IP_TABLE, [TEXT, TEXT + 4]), orc(8, SP))
    with pytest.raises(SymbolError, match="bad ORC tables"):
        OrcTable(IP_TABLE, b"\0\0\0", orc(8, SP)[:3])


# -- lookup ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("table_addr", [TEXT - 0x1000, TEXT + 0x10_0000], ids=["table-below", "table-above"])
def test_lookup_by_ip_with_relative_offsets(table_addr: int) -> None:
    ips = [TEXT, TEXT + 0x10, TEXT + 0x10, TEXT + 0x30]
    entries = orc(8, SP) + orc(0, UNDEF) + orc(24, SP) + orc(0, UNDEF)  # a terminator, then a real entry, at 0x10
    offsets = struct.unpack("<4i", ip_table(table_addr, ips))
    assert all(o > 0 for o in offsets) if table_addr < TEXT else all(o < 0 for o in offsets)
    table = OrcTable(table_addr, ip_table(table_addr, ips), entries)
    assert list(table.ips) == ips and len(table) == 4
    assert table.find(TEXT) == table.find(TEXT + 0xF) == OrcEntry(8, 0, SP, UNDEF, CALL, False)
    assert table.index(TEXT + 0x10) == table.index(TEXT + 0x2F) == 2  # the rightmost duplicate
    assert table.find(TEXT + 0x30) == OrcEntry(0, 0, UNDEF, UNDEF, CALL, False)
    assert table.find(TEXT - 1) is None and table.find(TEXT + 0x31) is None


def test_an_unsorted_table_is_sorted_with_terminators_first() -> None:
    ips = [TEXT + 0x20, TEXT, TEXT + 0x20, TEXT + 0x10]
    entries = orc(40, SP) + orc(8, SP) + orc(0, UNDEF) + orc(16, SP)
    table = OrcTable(IP_TABLE, ip_table(IP_TABLE, ips), entries)
    assert list(table.ips) == [TEXT, TEXT + 0x10, TEXT + 0x20, TEXT + 0x20]
    assert [table.entry(i).sp_offset for i in range(4)] == [8, 16, 0, 40]
    assert table.find(TEXT + 0x20).sp_offset == 40  # the rightmost: the real entry, not the terminator
    assert table.find(TEXT + 0x21) is None  # past the last entry (in a real table, its terminator)


def test_tables_load_from_the_file_once_and_lookups_apply_the_slide(symbols: Symbols) -> None:
    unwinder = OrcUnwinder(symbols)
    assert unwinder._table is None  # lazily
    assert unwinder.find(run("fp_func", 0x10)) == OrcEntry(16, -16, BP, PREV_SP, CALL, False)
    assert unwinder.find(link("fp_func", 0x10)) is None  # a link address is not where the kernel runs
    assert unwinder.table is unwinder.table
    assert unwinder.find(0).sp_reg == SP  # null_orc_entry
    assert unwinder_for(symbols) is unwinder_for(symbols)


def test_a_kernel_without_orc_is_a_clear_error(tmp_path: Path) -> None:
    unwinder = OrcUnwinder(build_symbols(tmp_path / "vmlinux", with_orc=False))
    with pytest.raises(SymbolError, match="CONFIG_UNWINDER_ORC"):
        unwinder.unwind({"ip": run("leaf"), "sp": S0}, FakeStack(STACK).read)


# -- unwinding -------------------------------------------------------------------------------------------
def syscall_stack(mem: FakeStack) -> None:
    """leaf <- mid <- fp_func <- entry_regs, the pt_regs of a syscall from user mode on top."""
    mem.put(S0, 0x1111, run("mid", 0x20))  # leaf pushed a register; its return address
    mem.put(S0 + 40, run("fp_func", 0x30))  # mid's frame is 32 bytes
    mem.put(S0 + 64, 0xBBBB, run("entry_regs", 0x20))  # fp_func: saved rbp at its bp, then the return address
    mem.pt_regs(S0 + 80, ip=0x40_1000, cs=USER_CS, sp=0x7FFC_0000_1000, bp=0x7FFC_0000_2000)


def test_call_frames_sp_and_bp_based_up_to_user_mode(unwinder: OrcUnwinder) -> None:
    mem = FakeStack(STACK)
    syscall_stack(mem)
    regs = {"ip": run("leaf", 1), "sp": S0, "bp": S0 + 64, "cs": KERNEL_CS}
    addrs = unwinder.unwind(regs, mem.read)
    # the user ip in the pt_regs is not kernel text: it ends the trace, unlisted
    assert names(addrs) == ["leaf+0x1", "mid+0x20", "fp_func+0x30", "entry_regs+0x20"]


def test_a_kernel_thread_ends_at_its_end_of_stack_hint(unwinder: OrcUnwinder) -> None:
    mem = FakeStack(STACK)
    mem.put(S0, run("kthread_end", 0x10))
    mem.put(S0 + 8, run("mid", 0x20))  # garbage beyond the end must not be followed
    assert names(unwinder.unwind({"ip": run("leaf"), "sp": S0}, mem.read)) == ["leaf+0x0", "kthread_end+0x10"]


def test_return_addresses_are_looked_up_one_byte_back(unwinder: OrcUnwinder) -> None:
    """mid ends with a noreturn call: its return address is after_mid's first byte, but mid's frame."""
    mem = FakeStack(STACK)
    mem.put(S0, run("mid", 0x40))
    mem.put(S0 + 8, run("fp_func", 0x30))  # where after_mid's rule (sp + 8) would wrongly look
    mem.put(S0 + 32, run("kthread_end", 0x10))  # mid's rule: sp + 32
    assert names(unwinder.unwind({"ip": run("leaf"), "sp": S0}, mem.read)) == [
        "leaf+0x0", "after_mid+0x0", "kthread_end+0x10",
    ]  # fmt: skip


def test_an_interrupted_ip_is_looked_up_as_is(unwinder: OrcUnwinder) -> None:
    """Below full pt_regs the ip is where the interrupt hit, not a return address: no one byte back."""
    mem = FakeStack(STACK)
    mem.put(S0, run("entry_regs", 0x20))
    s1 = S0 + 0x400
    mem.pt_regs(S0 + 8, ip=run("after_mid"), cs=KERNEL_CS, sp=s1, bp=0xB0B0)
    mem.put(s1, run("kthread_end", 0x10))  # after_mid's rule at its first byte: sp + 8
    mem.put(s1 + 24, run("fp_func", 0x30))  # mid's rule (sp + 32) would read this
    addrs = unwinder.unwind({"ip": run("leaf"), "sp": S0}, mem.read)
    assert names(addrs) == ["leaf+0x0", "entry_regs+0x20", "after_mid+0x0", "kthread_end+0x10"]


def test_sp_indirect_follows_the_pointer_to_the_previous_stack(unwinder: OrcUnwinder) -> None:
    mem = FakeStack(STACK, IRQ_STACK)
    top = IRQ_STACK + 0x3FF8
    mem.put(top, S0)  # the old sp, which call_on_stack() left at the top of the new stack
    mem.put(S0, run("kthread_end", 0x10))  # (%rsp) + 8 is the CFA: the return address is at the old sp
    addrs = unwinder.unwind({"ip": run("ind_func", 0x10), "sp": top}, mem.read)
    assert names(addrs) == ["ind_func+0x10", "kthread_end+0x10"]  # to a lower stack: not "going backwards"


def test_bp_indirect(unwinder: OrcUnwinder) -> None:
    mem = FakeStack(STACK)
    bp = S0 + 0x100
    mem.put(bp - 8, S0 + 0x40)  # (%rbp - 8) is the CFA
    mem.put(S0 + 0x38, run("kthread_end", 0x10))
    addrs = unwinder.unwind({"ip": run("bpind_func", 0x10), "sp": S0, "bp": bp}, mem.read)
    assert names(addrs) == ["bpind_func+0x10", "kthread_end+0x10"]


@pytest.mark.parametrize(("func", "reg"), [("r10_func", "r10"), ("r13_func", "r13"), ("di_func", "di"),
                                           ("dx_func", "dx")])  # fmt: skip
def test_sp_from_a_register_of_the_first_frame(unwinder: OrcUnwinder, func: str, reg: str) -> None:
    mem = FakeStack(STACK)
    mem.put(S0 + 0x18, run("kthread_end", 0x10))
    regs = {"ip": run(func, 4), "sp": S0, reg: S0 + 0x20}  # the register is the CFA itself (no offset)
    assert names(unwinder.unwind(regs, mem.read)) == [f"{func}+0x4", "kthread_end+0x10"]


def test_a_register_is_unknown_after_a_call_frame(unwinder: OrcUnwinder) -> None:
    mem = FakeStack(STACK)
    mem.put(S0, run("r10_func", 8))
    mem.put(S0 + 0x18, run("kthread_end", 0x10))
    regs = {"ip": run("leaf"), "sp": S0, "r10": S0 + 0x20}  # r10 of the leaf frame, not of r10_func's
    assert names(unwinder.unwind(regs, mem.read)) == ["leaf+0x0", "r10_func+0x8"]


def test_a_register_from_pt_regs_on_the_stack(unwinder: OrcUnwinder) -> None:
    mem = FakeStack(STACK)
    mem.put(S0, run("entry_regs", 0x20))
    s2 = S0 + 0x800
    mem.pt_regs(S0 + 8, ip=run("di_func", 2), cs=KERNEL_CS, sp=S0 + 0x400, di=s2)
    mem.put(s2 - 8, run("kthread_end", 0x10))
    addrs = unwinder.unwind({"ip": run("leaf"), "sp": S0}, mem.read)
    assert names(addrs) == ["leaf+0x0", "entry_regs+0x20", "di_func+0x2", "kthread_end+0x10"]


def test_an_iret_frame_after_full_regs_takes_registers_from_those(unwinder: OrcUnwinder) -> None:
    """REGS_PARTIAL: ip and sp from the iret frame; other registers only from the full regs it interrupted."""
    mem = FakeStack(STACK)
    mem.put(S0, run("dx_func", 3), KERNEL_CS, 0x246, S0 + 0x40, 0x18)  # ip, cs, flags, sp, ss
    mem.put(S0 + 0x58, run("kthread_end", 0x10))
    regs = {"ip": run("entry_iret", 0x10), "sp": S0, "dx": S0 + 0x60, "cs": KERNEL_CS}
    assert names(unwinder.unwind(regs, mem.read)) == ["entry_iret+0x10", "dx_func+0x3", "kthread_end+0x10"]


def test_an_iret_frame_after_a_call_frame_knows_no_registers(unwinder: OrcUnwinder) -> None:
    mem = FakeStack(STACK)
    mem.put(S0, run("entry_iret", 0x11))
    mem.put(S0 + 8, run("dx_func", 3), KERNEL_CS, 0x246, S0 + 0x80, 0x18)
    regs = {"ip": run("leaf"), "sp": S0, "dx": S0 + 0x60}
    assert names(unwinder.unwind(regs, mem.read)) == ["leaf+0x0", "entry_iret+0x11", "dx_func+0x3"]


def test_an_iret_frame_from_user_mode_ends_the_trace(unwinder: OrcUnwinder) -> None:
    mem = FakeStack(STACK)
    mem.put(S0, 0x40_2000, USER_CS, 0x246, 0x7FFC_0000_0000, 0x2B)
    addrs = unwinder.unwind({"ip": run("entry_iret", 0x10), "sp": S0}, mem.read)
    assert names(addrs) == ["entry_iret+0x10"]


def test_user_mode_registers_give_just_their_ip(unwinder: OrcUnwinder) -> None:
    mem = FakeStack(STACK)
    assert unwinder.unwind({"ip": 0x40_1000, "sp": 0x7FFC_0000_1000, "cs": USER_CS}, mem.read) == [0x40_1000]
    assert unwinder.unwind({"ip": 0x40_1000, "sp": 0x7FFC_0000_1000}, mem.read) == [0x40_1000]
    assert mem.reads == []


def test_a_call_through_null(unwinder: OrcUnwinder) -> None:
    mem = FakeStack(STACK)
    mem.put(S0, run("kthread_end", 0x10))
    assert names(unwinder.unwind({"ip": 0, "sp": S0, "cs": KERNEL_CS}, mem.read)) == ["0x0", "kthread_end+0x10"]


def test_an_ip_without_orc_data_is_listed_and_ends_the_trace(unwinder: OrcUnwinder) -> None:
    module = 0xFFFF_FFFF_C012_3456
    mem = FakeStack(STACK)
    mem.put(S0, module)
    assert unwinder.unwind({"ip": run("leaf"), "sp": S0}, mem.read) == [run("leaf"), module]
    assert unwinder.unwind({"ip": module, "sp": S0}, mem.read) == [module]
    # a section terminator (the end of .text) is an error too
    end = TEXT + 0x900 + SLIDE
    assert unwinder.find(end) == OrcEntry(0, 0, UNDEF, UNDEF, CALL, False)
    assert unwinder.unwind({"ip": end, "sp": S0}, mem.read) == [end]


def test_a_read_fault_ends_the_trace(unwinder: OrcUnwinder) -> None:
    mem = FakeStack(STACK)
    sp = STACK + 0x4000 - 8
    mem.put(sp, run("mid", 0x20))  # mid's frame reaches past the end of the stack
    assert names(unwinder.unwind({"ip": run("leaf"), "sp": sp}, mem.read)) == ["leaf+0x0", "mid+0x20"]

    def raising(addr: int, n: int) -> bytes:
        raise RuntimeError("the stub went away")

    assert unwinder.unwind({"ip": run("leaf"), "sp": S0}, raising) == [run("leaf")]


def test_bad_data_going_down_the_same_stack_stops(unwinder: OrcUnwinder) -> None:
    mem = FakeStack(STACK)
    mem.put(S0 - 0x18, run("kthread_end", 0x10))
    assert names(unwinder.unwind({"ip": run("backwards"), "sp": S0}, mem.read)) == ["backwards+0x0"]


def test_at_most_max_frames(unwinder: OrcUnwinder) -> None:
    mem = FakeStack(STACK)
    for i in range(200):  # deep recursion: rec's frame is 16 bytes
        mem.put(STACK + 0x100 + 16 * i + 8, run("rec", 0x10))
    regs = {"ip": run("rec", 0x10), "sp": STACK + 0x100}
    assert len(unwinder.unwind(regs, mem.read)) == 64
    assert names(unwinder.unwind(regs, mem.read, max_frames=3)) == ["rec+0x10"] * 3
    assert unwinder.unwind(regs, mem.read, max_frames=1) == [run("rec", 0x10)]
    assert unwinder.unwind(regs, mem.read, max_frames=0) == []


TRAMPOLINE = 0xFFFF_FFFF_9E00_0000  # qprobe's scratch area: no ORC data


def test_fix_return_maps_the_kretprobe_trampoline_at_its_slot(unwinder: OrcUnwinder) -> None:
    mem = FakeStack(STACK)
    syscall_stack(mem)
    mem.put(S0 + 40, TRAMPOLINE)  # mid was return-probed: its return address into fp_func was replaced
    instance = SimpleNamespace(ret_addr=run("fp_func", 0x30))
    kretprobes = SimpleNamespace(trampoline=TRAMPOLINE, by_slot={S0 + 40: instance})
    calls = []

    def fix(slot: int, value: int) -> int:
        calls.append((slot, value))
        return return_fixer(kretprobes)(slot, value)

    regs = {"ip": run("leaf", 1), "sp": S0, "bp": S0 + 64}
    assert names(unwinder.unwind(regs, mem.read, fix_return=fix)) == [
        "leaf+0x1", "mid+0x20", "fp_func+0x30", "entry_regs+0x20",
    ]  # fmt: skip
    # every return address read from the stack went through it, at its own slot
    assert calls[:4] == [(S0 - 8, run("leaf", 1)), (S0 + 8, run("mid", 0x20)), (S0 + 40, TRAMPOLINE),
                         (S0 + 72, run("entry_regs", 0x20))]  # fmt: skip
    # without it the trampoline shows, and nothing past it can be unwound
    assert unwinder.unwind(regs, mem.read) == [run("leaf", 1), run("mid", 0x20), TRAMPOLINE]


def test_a_return_handler_s_regs_start_at_the_real_return_address(unwinder: OrcUnwinder) -> None:
    """In a kretprobe handler ip is the trampoline and sp is just past the slot the ret popped."""
    mem = FakeStack(STACK)
    syscall_stack(mem)
    mem.put(S0 + 8, TRAMPOLINE)
    instance = SimpleNamespace(ret_addr=run("mid", 0x20))
    fix = return_fixer(SimpleNamespace(trampoline=TRAMPOLINE, by_slot={S0 + 8: instance}))
    regs = {"ip": TRAMPOLINE, "sp": S0 + 16, "bp": S0 + 64}
    assert names(unwinder.unwind(regs, mem.read, fix_return=fix)) == ["mid+0x20", "fp_func+0x30", "entry_regs+0x20"]


def test_return_fixer_leaves_everything_else_alone() -> None:
    fix = return_fixer(SimpleNamespace(trampoline=TRAMPOLINE, by_slot={0x100: SimpleNamespace(ret_addr=0x42)}))
    assert fix(0x100, TRAMPOLINE) == 0x42
    assert fix(0x108, TRAMPOLINE) == TRAMPOLINE  # no instance at that slot
    assert fix(0x100, 0x1234) == 0x1234
    assert return_fixer(SimpleNamespace(trampoline=0, by_slot={}))(0x100, 0) == 0  # no trampoline yet


# -- formatting ------------------------------------------------------------------------------------------
def test_format_stack_is_proc_pid_stack(symbols: Symbols) -> None:
    lines = format_stack([run("leaf", 1), run("mid", 0x20), run("mid", 0x40), run("kthread_end", 0x10),
                          0xFFFF_FFFF_C012_3456], symbols)  # fmt: skip
    assert lines == [
        "[<0>] leaf+0x1/0x100",  # the size is kallsyms's: to the next symbol (mid), not st_size
        "[<0>] mid+0x20/0x40",
        "[<0>] mid+0x40/0x40",  # %pB: a return address is named after its call, not after_mid+0x0
        "[<0>] kthread_end+0x10/0x40",
        "[<0>] 0xffffffffc0123456",
    ]
    # the first address is where execution is: after_mid's first byte is after_mid's
    assert format_stack([run("after_mid")], symbols) == ["[<0>] after_mid+0x0/0xc0"]
    assert format_stack([], symbols) == []


# -- the real vmlinux --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real() -> Iterator[tuple[Symbols, OrcUnwinder]]:
    from qprobe.images import get_image

    try:
        image = get_image("debian-cloud", fetch=False, progress=False)
    except ImageError as exc:
        pytest.skip(f"no cached debian-cloud kernel to read real ORC tables from: {exc}")
    symbols = Symbols.load(image.vmlinux)
    yield symbols, OrcUnwinder(symbols)


def test_real_tables_are_sorted_and_decodable(real: tuple[Symbols, OrcUnwinder]) -> None:
    symbols, unwinder = real
    ip_sec, orc_sec = symbols.section(".orc_unwind_ip"), symbols.section(".orc_unwind")
    assert ip_sec is not None and orc_sec is not None
    table = unwinder.table
    assert len(table) == ip_sec.size // 4 == orc_sec.size // 6 and ip_sec.size % 4 == 0
    raw = symbols.file_bytes(ip_sec.addr + symbols.slide, ip_sec.size)
    decoded = [ip_sec.addr + 4 * i + off for i, (off,) in enumerate(struct.iter_unpack("<i", raw))]
    assert decoded == list(table.ips)  # sorted at build time: the loader did not need to reorder
    assert all(a <= b for a, b in itertools.pairwise(decoded))
    spans = sorted((s.addr, s.addr + s.size) for s in symbols.sections if s.executable)
    starts = [a for a, _ in spans]
    outside = [ip for ip in decoded if ip < starts[0] or ip > spans[bisect.bisect_right(starts, ip) - 1][1]]
    assert outside == []  # every entry is in code (a section's terminator sits at its very end)
    entries = [table.entry(i) for i in range(len(table))]
    assert {e.type for e in entries} <= {CALL, REGS, PARTIAL}
    assert {e.sp_reg for e in entries} <= {UNDEF, DX, DI, BP, SP, R10, R13, BP_IND, SP_IND}
    assert {e.bp_reg for e in entries} <= {UNDEF, PREV_SP, BP}
    ends = [e for e in entries if e.end]
    assert ends and all(e.sp_reg == UNDEF for e in ends)  # end only on end-of-stack hints


def test_real_lookups(real: tuple[Symbols, OrcUnwinder]) -> None:
    symbols, unwinder = real
    slid = symbols.slide + 0x2A0_0000  # lookups move with KASLR
    old = symbols.slide
    for slide in (old, slid):
        symbols.slide = slide
        try:
            for name in ("ksys_lseek", "do_nanosleep", "hrtimer_nanosleep", "vfs_read"):
                assert unwinder.find(symbols.address(name)) == OrcEntry(8, 0, SP, UNDEF, CALL, False), name
            for name in ("ret_from_fork", "entry_SYSCALL_64"):
                assert unwinder.find(symbols.address(name)).end, name
            # do_syscall_64 returns into entry_SYSCALL_64 with the user's pt_regs at sp
            entry = unwinder.find(symbols.address("entry_SYSCALL_64_after_hwframe") + 0x40)
            assert (entry.type, entry.sp_reg, entry.sp_offset) == (REGS, SP, 0)
        finally:
            symbols.slide = old
