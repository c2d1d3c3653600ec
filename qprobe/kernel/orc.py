"""Kernel stack traces unwound on the host from vmlinux's ORC tables (Linux 6.1, x86_64).

Debian builds its kernels with ``CONFIG_UNWINDER_ORC`` and without frame
pointers, so the only way to walk a guest kernel stack is the way the kernel
does it: objtool's ``.orc_unwind_ip`` (one s32 per entry, relative to the
entry's own address, sorted at build time) says where each run of
instructions starts, and ``.orc_unwind`` (6 bytes per entry, the same index)
says how to find the caller's stack pointer, its frame pointer and the
return address from there.  This module reimplements
``arch/x86/kernel/unwind_orc.c`` of 6.1 in Python: the tables are read from
the vmlinux file (their contents never change at run time; the KASLR slide
moves every address by the same amount, which the relative encoding absorbs)
and the stack is read from guest memory through the caller's ``read``.

``.orc_lookup`` is not used: in the file it is all zeros (``unwind_init()``
fills it at boot), and a bisect over the whole ip table is what the kernel
itself does for init text; it is fast enough for any table size.

The entry layout is 6.1's (it changed in 6.3 and again in 6.4)::

    struct orc_entry {
        s16 sp_offset;
        s16 bp_offset;
        unsigned sp_reg:4;   /* bits 0-3 of the third u16 */
        unsigned bp_reg:4;   /* bits 4-7 */
        unsigned type:2;     /* bits 8-9: ORC_TYPE_CALL 0, REGS 1, REGS_PARTIAL 2 */
        unsigned end:1;      /* bit 10: the sp_reg UNDEFINED entry ends the stack */
    } __packed;

A table in a later layout (a type of 3, a bit above 10 set) is refused rather
than misread.
"""

from __future__ import annotations

import bisect
import operator
import struct
import weakref
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from qprobe.errors import SymbolError

if TYPE_CHECKING:
    from qprobe.kernel.symbols import Section, Symbols

# ORC_REG_* (arch/x86/include/asm/orc_types.h)
ORC_REG_UNDEFINED = 0
ORC_REG_PREV_SP = 1
ORC_REG_DX = 2
ORC_REG_DI = 3
ORC_REG_BP = 4
ORC_REG_SP = 5
ORC_REG_R10 = 6
ORC_REG_R13 = 7
ORC_REG_BP_INDIRECT = 8
ORC_REG_SP_INDIRECT = 9
# Entry types as objtool writes them in 6.1 (UNWIND_HINT_TYPE_*).
ORC_TYPE_CALL = 0
ORC_TYPE_REGS = 1
ORC_TYPE_REGS_PARTIAL = 2

ORC_ENTRY = struct.Struct("<hhH")

# struct pt_regs, in order: the offset of each field is 8 * its index.
PT_REGS_FIELDS = ("r15", "r14", "r13", "r12", "bp", "bx", "r11", "r10", "r9", "r8", "ax", "cx", "dx", "si", "di",
                  "orig_ax", "ip", "cs", "flags", "sp", "ss")  # fmt: skip
PT_REGS_OFFSET = {name: 8 * i for i, name in enumerate(PT_REGS_FIELDS)}
PT_REGS_SIZE = 8 * len(PT_REGS_FIELDS)
IRET_FRAME_OFFSET = PT_REGS_OFFSET["ip"]  # an iret frame is the tail of pt_regs: ip, cs, flags, sp, ss
IRET_FRAME_SIZE = PT_REGS_SIZE - IRET_FRAME_OFFSET
_SP_BASE_REGS = {ORC_REG_R10: "r10", ORC_REG_R13: "r13", ORC_REG_DI: "di", ORC_REG_DX: "dx"}

KERNEL_HALF = 0xFFFF_8000_0000_0000  # canonical addresses at or above this are the kernel's
_MASK = (1 << 64) - 1
_STACK_BLOCK = 16 << 10  # THREAD_SIZE and IRQ_STACK_SIZE on x86_64 (without KASAN)

ReadFn = Callable[[int, int], bytes]
FixReturn = Callable[[int, int], int]


@dataclass(frozen=True, slots=True)
class OrcEntry:
    """One decoded ``struct orc_entry``."""

    sp_offset: int
    bp_offset: int
    sp_reg: int
    bp_reg: int
    type: int
    end: bool

    @classmethod
    def unpack(cls, data: bytes | memoryview, offset: int = 0) -> OrcEntry:
        sp_offset, bp_offset, bits = ORC_ENTRY.unpack_from(data, offset)
        return cls(sp_offset, bp_offset, bits & 0xF, (bits >> 4) & 0xF, (bits >> 8) & 0x3, bool(bits >> 10 & 1))

    @property
    def terminator(self) -> bool:
        """A "weak" section-end entry (no unwind data): the kernel stops with an error there."""
        return self.sp_reg == ORC_REG_UNDEFINED and not self.end


# unwind_orc.c's null_orc_entry: at ip 0 (a call through a NULL pointer) the return address is at sp.
NULL_ORC_ENTRY = OrcEntry(8, 0, ORC_REG_SP, ORC_REG_UNDEFINED, ORC_TYPE_CALL, False)


class OrcTable:
    """The two parallel ORC tables of one vmlinux, at link-time addresses, ready for bisect.

    ``ips`` holds the absolute (link-time) start address of every entry, so a
    lookup is one C-level bisect; the 6-byte entries stay packed in
    ``entries`` and are decoded only when found.
    """

    def __init__(self, ip_table_addr: int, ip_table: bytes, entries: bytes) -> None:
        if len(ip_table) % 4 or len(entries) % ORC_ENTRY.size or len(ip_table) // 4 != len(entries) // ORC_ENTRY.size:
            raise SymbolError(f"bad ORC tables: {len(ip_table)} bytes of .orc_unwind_ip for "
                              f"{len(entries)} bytes of .orc_unwind")  # fmt: skip
        _check_layout(entries)
        offsets = array("i")
        offsets.frombytes(ip_table)
        n = len(offsets)
        # orc_ip(): each s32 is relative to its own address.
        ips = array("Q", map(operator.add, offsets, range(ip_table_addr, ip_table_addr + 4 * n, 4)))
        if any(map(operator.gt, ips, ips[1:])):
            ips, entries = _sort(ips, entries)
        self.ips = ips
        self.entries = bytes(entries)

    def __len__(self) -> int:
        return len(self.ips)

    def entry(self, index: int) -> OrcEntry:
        return OrcEntry.unpack(self.entries, index * ORC_ENTRY.size)

    def index(self, link_ip: int) -> int | None:
        """The rightmost entry starting at or below ``link_ip`` (``__orc_find``), None outside the table."""
        if not self.ips or not self.ips[0] <= link_ip <= self.ips[-1]:
            return None
        return bisect.bisect_right(self.ips, link_ip) - 1

    def find(self, link_ip: int) -> OrcEntry | None:
        i = self.index(link_ip)
        return None if i is None else self.entry(i)

    @classmethod
    def from_symbols(cls, symbols: Symbols) -> OrcTable:
        """Both tables, read from the vmlinux file at their running addresses."""
        ip_sec, orc_sec = _section(symbols, ".orc_unwind_ip"), _section(symbols, ".orc_unwind")
        ip_bytes = symbols.file_bytes(ip_sec.addr + symbols.slide, ip_sec.size)
        orc_bytes = symbols.file_bytes(orc_sec.addr + symbols.slide, orc_sec.size)
        return cls(ip_sec.addr, ip_bytes, orc_bytes)


def _section(symbols: Symbols, name: str) -> Section:
    sec = symbols.section(name)
    if sec is None:
        raise SymbolError(f"{symbols.path.name} has no {name} section: the kernel was not built with "
                          "CONFIG_UNWINDER_ORC, so its stacks cannot be unwound")  # fmt: skip
    return sec


def _check_layout(entries: bytes) -> None:
    """Refuse tables written in another kernel's layout: they would decode to nonsense, silently."""
    high = set(entries[5 :: ORC_ENTRY.size])  # the high byte of each entry's bitfield word
    if any(b & 0xF8 or b & 0x3 == 0x3 for b in high):
        raise SymbolError("the ORC entries are not in Linux 6.1's layout (type:2 end:1); "
                          "this kernel is probably 6.3 or later, which this unwinder does not read")  # fmt: skip


def _sort(ips: array, entries: bytes) -> tuple[array, bytes]:
    """Sort as the kernel's orc_sort_cmp: by ip, section terminators before real entries at the same ip."""
    size = ORC_ENTRY.size

    def key(i: int) -> tuple[int, int]:
        return ips[i], 0 if OrcEntry.unpack(entries, i * size).terminator else 1

    order = sorted(range(len(ips)), key=key)
    return array("Q", (ips[i] for i in order)), b"".join(entries[i * size : (i + 1) * size] for i in order)


@dataclass
class _State:
    """``struct unwind_state``, the parts that matter on the host.

    ``regs`` is where the last frame's registers are: the caller's mapping for
    the first frame, else the guest address of a pt_regs on the stack (for an
    iret frame, of the pt_regs it is the tail of, as in the kernel).
    """

    ip: int
    sp: int
    bp: int
    signal: bool
    regs: Mapping[str, int] | int | None
    full_regs: bool
    prev_regs: Mapping[str, int] | int | None = None


class OrcUnwinder:
    """Unwinds guest kernel stacks with one vmlinux's ORC data.

    The tables load on first use (about 0.1 s for Debian's 368k entries) and
    are kept, so one unwinder serves every hit of a session.
    """

    def __init__(self, symbols: Symbols) -> None:
        self.symbols = symbols
        self._table: OrcTable | None = None

    @property
    def table(self) -> OrcTable:
        if self._table is None:
            self._table = OrcTable.from_symbols(self.symbols)
        return self._table

    def find(self, ip: int) -> OrcEntry | None:
        """The ORC entry covering running address ``ip`` (None: not vmlinux text, e.g. a module)."""
        if ip == 0:
            return NULL_ORC_ENTRY
        return self.table.find((ip - self.symbols.slide) & _MASK)

    def unwind(self, regs: Mapping[str, int], read: ReadFn, *, max_frames: int = 64,
               fix_return: FixReturn | None = None) -> list[int]:  # fmt: skip
        """The kernel call chain at ``regs``: its ip, then every return address, innermost first.

        ``regs`` has pt_regs names (ip, sp, bp, the GPRs, cs if known);
        ``read(addr, n)`` reads guest kernel memory and raises on a fault,
        which ends the walk there.  ``fix_return(slot, value)`` maps a value
        read from stack slot ``slot`` to the real return address (qprobe's
        kretprobe trampoline to the instance's saved one).  It is also applied
        to ``regs["ip"]`` with the slot just below sp, because a return
        handler's regs stop at the trampoline right after the ``ret`` popped
        that slot.

        The walk stops as the kernel's does: at the user-mode registers a
        syscall or an interrupt from user space saved (whose ip is not
        listed), at a kernel thread's end-of-stack hint, at an ip without
        ORC data (a module, BPF, a trampoline: the kernel would guess a frame
        pointer, which Debian's code does not keep), on a read fault, on ORC
        data that makes no sense, or after ``max_frames`` addresses.
        """
        fix = fix_return or _identity
        if max_frames <= 0:
            return []
        _ = self.table  # a vmlinux without ORC tables is an error to report, not a short trace
        ip, sp = regs["ip"] & _MASK, regs["sp"] & _MASK
        ip = fix((sp - 8) & _MASK, ip)
        out = [ip]
        if _user_mode(regs.get("cs"), ip):
            return out  # arch_stack_walk() reports regs->ip, then __unwind_start() finds nothing to walk
        state = _State(ip=ip, sp=sp, bp=regs.get("bp", 0) & _MASK, signal=True, regs=regs, full_regs=True)
        while len(out) < max_frames:
            try:
                more = self._step(state, read, fix)
            except Exception:  # any fault of the caller's reader ends the walk, as documented
                more = False
            if not more:
                break
            if state.ip < KERNEL_HALF:
                break  # a user address is not kernel text: unwind_get_return_address() gives 0 and the walk ends
            out.append(state.ip)
        return out

    # -- one frame: unwind_next_frame() ----------------------------------------------
    def _step(self, st: _State, read: ReadFn, fix: FixReturn) -> bool:
        """Move ``st`` to the caller's frame; False at the end of the stack or on an error."""
        if isinstance(st.regs, int) and _user_mode(_u64(read, st.regs + PT_REGS_OFFSET["cs"]), st.ip):
            return False
        # A return address is looked up one byte back: the call may be the last instruction
        # (a noreturn callee), and the next one can belong to another function.
        orc = self.find(st.ip if st.signal else st.ip - 1)
        if orc is None or orc.sp_reg == ORC_REG_UNDEFINED:
            return False  # no data, a section terminator, or (with orc.end) the end of a kernel thread's stack
        prev_sp = st.sp

        # The caller's stack pointer (the "CFA").
        if orc.sp_reg == ORC_REG_SP:
            sp = st.sp + orc.sp_offset
        elif orc.sp_reg == ORC_REG_BP:
            sp = st.bp + orc.sp_offset
        elif orc.sp_reg == ORC_REG_SP_INDIRECT:
            sp = _u64(read, st.sp) + orc.sp_offset  # (%rsp) + offset: the pointer call_on_stack() leaves
        elif orc.sp_reg == ORC_REG_BP_INDIRECT:
            sp = _u64(read, (st.bp + orc.sp_offset) & _MASK)  # (%rbp + offset): DRAP
        elif orc.sp_reg in _SP_BASE_REGS:
            value = self._get_reg(st, _SP_BASE_REGS[orc.sp_reg], read)
            if value is None:
                return False
            sp = value
        else:
            return False
        sp &= _MASK

        # The caller's ip, and its registers when this frame saved them.
        if orc.type == ORC_TYPE_CALL:
            slot = (sp - 8) & _MASK
            st.ip = fix(slot, _u64(read, slot))
            st.sp = sp
            st.regs = st.prev_regs = None
            st.signal = False
        elif orc.type == ORC_TYPE_REGS:
            frame = read(sp, PT_REGS_SIZE)
            ip, new_sp = _field(frame, "ip"), _field(frame, "sp")
            st.ip, st.sp = fix((new_sp - 8) & _MASK, ip), new_sp
            st.regs, st.prev_regs, st.full_regs, st.signal = sp, None, True, True
        elif orc.type == ORC_TYPE_REGS_PARTIAL:
            frame = read(sp, IRET_FRAME_SIZE)
            ip, new_sp = _field(frame, "ip", IRET_FRAME_OFFSET), _field(frame, "sp", IRET_FRAME_OFFSET)
            st.ip, st.sp = fix((new_sp - 8) & _MASK, ip), new_sp
            if st.full_regs:
                st.prev_regs = st.regs
            st.regs, st.full_regs, st.signal = (sp - IRET_FRAME_OFFSET) & _MASK, False, True
        else:
            return False

        # The caller's frame pointer.
        if orc.bp_reg == ORC_REG_UNDEFINED:
            bp = self._get_reg(st, "bp", read)
            if bp is not None:
                st.bp = bp
        elif orc.bp_reg == ORC_REG_PREV_SP:
            st.bp = _u64(read, (sp + orc.bp_offset) & _MASK)
        elif orc.bp_reg == ORC_REG_BP:
            st.bp = _u64(read, (st.bp + orc.bp_offset) & _MASK)
        else:
            return False

        # Bad data must not loop: on one stack, the caller's frame is always above.
        return not (st.sp <= prev_sp and st.sp // _STACK_BLOCK == prev_sp // _STACK_BLOCK)

    @staticmethod
    def _get_reg(st: _State, name: str, read: ReadFn) -> int | None:
        """get_reg(): from full pt_regs, or from the full ones an iret frame interrupted; else unknown."""
        if st.regs is None:
            return None
        src = st.regs if st.full_regs else st.prev_regs
        if src is None:
            return None
        if isinstance(src, int):
            return _u64(read, src + PT_REGS_OFFSET[name])
        value = src.get(name)
        return None if value is None else value & _MASK


def _identity(_slot: int, value: int) -> int:
    return value


def _u64(read: ReadFn, addr: int) -> int:
    return int.from_bytes(read(addr & _MASK, 8)[:8], "little")


def _field(frame: bytes, name: str, base: int = 0) -> int:
    off = PT_REGS_OFFSET[name] - base
    return int.from_bytes(frame[off : off + 8], "little")


def _user_mode(cs: int | None, ip: int) -> bool:
    """user_mode(regs): CS's RPL, or (when CS is not known) the half of the address space ip is in."""
    return bool(cs & 3) if cs is not None else ip < KERNEL_HALF


# -- qprobe glue --------------------------------------------------------------------------
class _Kretprobes(Protocol):
    trampoline: int
    by_slot: Mapping[int, object]


def return_fixer(kretprobes: _Kretprobes) -> FixReturn:
    """``fix_return`` for qprobe's kretprobes: the trampoline at slot S is ``by_slot[S].ret_addr``.

    The kernel's unwinder does the same with kretprobe_find_ret_addr(); here
    the instances live on the host, keyed by the stack slot they patched.
    """

    def fix(slot: int, value: int) -> int:
        if value and value == kretprobes.trampoline:
            ri = kretprobes.by_slot.get(slot)
            if ri is not None:
                return int(ri.ret_addr)  # type: ignore[attr-defined]
        return value

    return fix


_unwinders: weakref.WeakKeyDictionary[Symbols, OrcUnwinder] = weakref.WeakKeyDictionary()


def unwinder_for(symbols: Symbols) -> OrcUnwinder:
    """One shared unwinder per Symbols, so the tables load once per session, not once per hit."""
    unwinder = _unwinders.get(symbols)
    if unwinder is None:
        unwinder = _unwinders[symbols] = OrcUnwinder(symbols)
    return unwinder


# -- formatting ----------------------------------------------------------------------------
def format_stack(addrs: list[int], symbols: Symbols) -> list[str]:
    """Lines as the guest's ``/proc/PID/stack`` prints them: ``[<0>] do_nanosleep+0x6f/0x140``.

    Like the kernel's ``%pB``, a return address is named after the byte
    before it (the call), so a call to a noreturn function at the very end of
    a function is not shown as the start of the next one; the first address
    is where execution is and is named as it is.  The size is kallsyms's:
    the distance to the next symbol, padding included (not ELF's st_size).
    ``[<0>]`` is what the kernel prints to everyone (kptr_restrict hashing).
    """
    lines = []
    for i, addr in enumerate(addrs):
        lines.append(f"[<0>] {_backtrace_symbol(symbols, addr, 0 if i == 0 else 1)}")
    return lines


def _backtrace_symbol(symbols: Symbols, addr: int, back: int) -> str:
    look = addr - back
    if symbols.section_at(look) is None:
        return f"{addr:#x}"  # not vmlinux (a module, BPF, qprobe's scratch area): kallsyms has no name either
    sym = symbols.containing(look)
    start: int | None = sym.addr if sym is not None else None
    name = sym.name if sym is not None else None
    table = getattr(symbols, "_addrs", None)
    rows = getattr(symbols, "_rows", None)
    nxt = None
    if table is not None:
        link = look - symbols.slide
        i = bisect.bisect_right(table, link)
        if sym is None and i > 0 and rows is not None:  # past st_size (padding): kallsyms still names it
            start, name = table[i - 1] + symbols.slide, rows[i - 1][2]
        nxt = table[i] + symbols.slide if i < len(table) else None
    if start is None or name is None:
        return f"{addr:#x}"
    size = nxt - start if nxt is not None else (sym.size if sym is not None else 0)
    return f"{name}+{addr - start:#x}/{size:#x}"
