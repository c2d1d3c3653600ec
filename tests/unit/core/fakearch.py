"""A toy architecture and a toy target, to test the kprobes core without x86_64.

``Toy`` implements qprobe.arch's ``Arch`` for a made-up ISA of fixed 4-byte
instructions (as arm64's), whose breakpoint is 4 bytes too: nothing in the
core may assume x86's one-byte int3 or its register names.  Its exceptions are
arm64's: every one (a BRK, a fault on memory that is not mapped, an undefined
instruction) enters the one vector ``ENTRY`` (arm64's ``el1h_64_sync``), with
the trapped pc in ``elr``, its flags in ``spsr`` and the syndrome in ``esr``
(ESR_EL1's exception class in bits 31:26, a BRK's immediate in the low 16
bits), so nothing may take every stop on the trap entry for a breakpoint.
kprobes' BRKs have their own immediates (a probe's and the one after a
trap-stepped copy), and the toy kernel has BRKs of its own (BUG's).  A
function returns through its link register ``lr``, as on arm64, so nothing
may assume a return address on the stack.

``ToyCpu`` is the gdbstub client (qprobe.vmm.transport.GdbTransport) of
vCPUs that really execute the toy ISA on a ``ToyMemory``: one bytearray of
guest RAM, with kernel text, the scratch area and a stack mapped into it.
``ToyMachine``, ``ToyScratch``, ``ToySymbols`` and ``ToyKernel`` are the
rest of what the core's managers take.  Instructions:

====  =========  =====================================================
op    name       what it does
====  =========  =====================================================
0x01  NOP        nothing; probes emulate it on the host
0x02  ADDI imm   r0 += imm16; runs out of line, may be boosted
0x03  LDR        r1 = [sp]; runs out of line, single-stepped by the host
0x04  RET        pc = lr, the link register, as arm64's (cannot be probed)
0x05  JMPL       pc = the u64 after it (cannot be probed)
0x06  BTI        a function's landing pad (probes go past it, as ENDBR)
0xBB  BRK imm    the breakpoint: an exception to ENTRY, ``imm`` (16 bits) in ``esr``
0x00  (invalid)  an undefined-instruction exception to ENTRY; cannot be probed
====  =========  =====================================================
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from qprobe.arch import (
    ArchBlacklist,
    BootStage,
    BreakHook,
    MailboxRequest,
    Memory,
    PageTables,
    PercpuLayout,
    Prepared,
    RegisterLayout,
    Resume,
    ResumeKind,
    ReturnHijack,
    ReturnLayout,
    RingEntry,
    Trap,
    TrapHook,
    UserMemory,
)
from qprobe.arch.inguest import KeySpec, MapKey, MapSlot
from qprobe.core.kprobes import KprobeManager
from qprobe.core.regsmaker import RegsMaker
from qprobe.core.table import ProbeTable
from qprobe.errors import InvalidProbe, ProbeError, ProtocolError, SymbolError
from qprobe.kernel.symbols import Symbol
from qprobe.vmm.journal import Patch
from qprobe.vmm.machine import Machine
from qprobe.vmm.memory import MemoryFault
from qprobe.vmm.rsp import StopReply

NOP, ADDI, LDR, RET, JMPL, BTI, BRK_OP, UNDEF = 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0xBB, 0x00
# BRK immediates, arm64's (arch/arm64/include/asm/brk-imm.h): kprobes' two, and BUG()'s.
KPROBES_BRK_IMM, KPROBES_BRK_SS_IMM, BUG_BRK_IMM = 0x004, 0x006, 0x800
# The syndrome: esr's exception class (ESR_ELx_EC_*) and the BRK immediate's mask (ESR_ELx_BRK64_ISS_COMMENT_MASK).
EC_UNKNOWN, EC_DABT_LOW, EC_DABT_CUR, EC_BRK64, EC_SHIFT, BRK_IMM_MASK = 0x00, 0x24, 0x25, 0x3C, 26, 0xFFFF
IRQ = 0x80  # the flags bit set while interrupts are enabled
USER = 0x01  # the flags bit set in user mode
STATE_REQUEST, STATE_DONE = 1, 2  # a mailbox's state word
STEP_COPY = 16  # a slot: the boosted copy [copy, JMPL, its target], then the trap-stepped one [copy, BRK]

# Guest virtual layout -> guest RAM.
TEXT, TEXT_PHYS, TEXT_SIZE = 0xFFFF_8000_0000_0000, 0x0, 0x10000
SCRATCH, SCRATCH_PHYS, SCRATCH_SIZE = 0xFFFF_A000_0000_0000, 0x20000, 0x40000
STACK, STACK_PHYS, STACK_SIZE = 0xFFFF_C000_0000_0000, 0x80000, 0x10000
USER_PHYS, PAGE = 0xA0000, 0x1000  # frames for user pages: [USER_PHYS, RAM_SIZE)
RAM_SIZE = 0x100000
USER_END = 0x8000_0000  # the toy's TASK_SIZE_MAX
TOY_USER_PAGE = 1  # the toy's leaf entries: a user page, or not
ENTRY = TEXT + 0x100  # the one vector every exception enters (its symbol: ToyTraps.trap_entries')


def insn(op: int, imm: int = 0) -> bytes:
    return bytes([op]) + (imm & 0xFFFFFF).to_bytes(3, "little")


BRK = insn(BRK_OP, KPROBES_BRK_IMM)  # a probe's breakpoint (and a return trampoline's)
BRK_SS = insn(BRK_OP, KPROBES_BRK_SS_IMM)  # the breakpoint after a trap-stepped copy


# -- the architecture -------------------------------------------------------------------


@dataclass
class ToyPrepared:
    addr: int
    slot_addr: int
    copy: bytes
    emulate: str | None
    boostable: bool
    step_reason: str | None

    @property
    def length(self) -> int:
        return len(self.copy)

    def boosted_copy(self) -> bytes:
        return self.copy


@dataclass
class ToyReturnLayout:
    instances: int
    count: int
    trampolines: int
    returns: int

    def trampoline(self, i: int) -> int:
        return self.trampolines + 8 * i

    def instance(self, i: int) -> int:
        return self.instances + ToyGuestRam.instance_size * i


class ToyTrapStep:
    """The toy's trap-step: the slot's second copy, followed by a BRK (arm64's way)."""

    def is_trap_step_start(self, prep: Prepared, ip: int) -> bool:
        return ip == prep.slot_addr + STEP_COPY

    def is_trap_step_end(self, prep: Prepared, addr: int) -> bool:
        return addr == prep.slot_addr + STEP_COPY + 4

    def arch_resume_trap_step(self, prep: Prepared, regs: Any) -> None:
        regs.set_quietly("ip", prep.addr + 4)
        regs.set_quietly("flags", regs.flags | IRQ)


class ToyUprobes:
    """The toy's answers for user-space probes."""

    uprobe_swbp_insn_size = 4  # every toy instruction is a word

    def arch_uprobe_analyze_insn(self, code: bytes) -> str | None:
        return "a breakpoint is there already (ENOTSUPP)" if code[:1] == bytes([BRK_OP]) else None

    def arch_uprobe_xol_was_trapped(self, code: bytes, after: Mapping[str, int]) -> bool:
        return not after["psr"] & USER  # out of user mode; the toy has no system-call instruction

    def arch_uretprobe_frame(self, regs: Mapping[str, int], read: Callable[[int, int], bytes]) -> tuple[int, int]:
        return int.from_bytes(read(regs["sp"], 4), "little"), regs["sp"] + 4  # the toy's call pushes a word

    def arch_uprobe_emulate(self, regs: Any, mem: UserMemory) -> bool:
        """The toy performs its NOP on the host; everything else is stepped (and a page the task cannot fetch)."""
        try:
            if mem.fetch(regs.ip, 4)[0] != NOP:
                return False
        except MemoryFault:
            return False
        regs.ip += 4
        return True

    def user_page_allows(self, entry: int, access: str) -> bool:
        return bool(entry & TOY_USER_PAGE)


class ToyGuestRam:
    """The toy's guest-RAM layouts: a mailbox, record rings, keyed tables and kretprobe instances."""

    # A mailbox: u64 state, probe id, continue address, sp, r0, r1, then the answer's final ip and sp.
    mailbox_size = 64
    ring_header_size = 64
    ring_entries = 16
    ring_entry_size = 64
    ring_head = 0
    ring_tail = 8
    ring_waits = 16
    ring_lossy = 24
    drain_doorbell = 0xFF
    # An instance: u64 stack slot (0: free), return address, task, owner.
    instance_size = 32
    trampoline_id = 0

    def build_mailbox_stub(self, mailboxes: int, missed: int, percpu: PercpuLayout, port: int,
                           address: int) -> bytes:  # fmt: skip
        return BRK

    def build_record_stub(self, rings: int, ncpus: int, entries: int, lost: int, percpu: PercpuLayout,
                          pid_offset: int, comm_offset: int, port: int, address: int) -> bytes:  # fmt: skip
        return BRK

    def return_layout(self, instances: int, count: int, trampolines: int, returns: int, stub: int,
                      current_task: int) -> ToyReturnLayout:  # fmt: skip
        return ToyReturnLayout(instances, count, trampolines, returns)

    def build_return_trampolines(self, layout: ReturnLayout) -> bytes:
        return (BRK + insn(NOP)) * layout.count + BRK + BRK

    def return_int3s(self, layout: ReturnLayout) -> tuple[int, int]:
        end = layout.trampolines + 8 * layout.count
        return end, end + 4

    def return_trampoline(self, address: int, stub: int) -> bytes:
        return BRK

    def new_instance(self, owner: int, mailbox: bool) -> bytes:
        return struct.pack("<QQQQ", 0, 0, 0, owner | (mailbox << 32))

    def parse_instances(self, raw: bytes) -> list[tuple[int, int, int, int]]:
        out = []
        for n, (slot, ret, task, _owner) in enumerate(struct.iter_unpack("<QQQQ", raw)):
            if slot:
                out.append((n, slot, ret, task))
        return out

    def instance_return_field(self, layout: ReturnLayout, i: int) -> int:
        return layout.instance(i) + 8

    def trampoline_index(self, layout: ReturnLayout, value: int) -> int | None:
        off = value - layout.trampolines
        return off // 8 if 0 <= off < 8 * layout.count and off % 8 == 0 else None

    def read_mailbox(self, read: Callable[[int, int], bytes]) -> MailboxRequest | None:
        state, probe_id, cont, sp, r0, r1 = struct.unpack("<6Q", read(0, 48))
        if state != STATE_REQUEST:
            return None
        if probe_id > 0xFFFF:  # what a detour cannot have written: refused, as a hostile guest's
            raise ProtocolError(f"mailbox names probe {probe_id:#x}")
        return MailboxRequest(probe_id, {"r0": r0, "r1": r1, "sp": sp, "psr": IRQ}, cont, sp, sp)

    def mailbox_answer(self, changed: Mapping[str, int], final_ip: int, final_sp: int) -> list[tuple[int, bytes]]:
        writes = [(32 + 8 * ("r0", "r1").index(n), v.to_bytes(8, "little")) for n, v in changed.items()
                  if n in ("r0", "r1")]  # fmt: skip
        writes.append((48, struct.pack("<QQ", final_ip, final_sp)))
        writes.append((0, STATE_DONE.to_bytes(8, "little")))
        return writes

    def parse_ring_entries(self, raw: bytes) -> list[RingEntry]:
        return [RingEntry(probe_id, cpu, pid, "", task, cycles, sp, {"r0": r0, "r1": r1, "sp": sp})
                for probe_id, cpu, pid, task, cycles, sp, r0, r1 in struct.iter_unpack("<8Q", raw)]  # fmt: skip

    def guest_map_size(self, spec: KeySpec) -> int:
        return 64 * (spec.words + 1) * 8

    def parse_guest_map(self, spec: KeySpec, raw: bytes) -> dict[MapKey, MapSlot]:
        n = spec.words + 1
        rows = (struct.unpack_from(f"<{n}Q", raw, i * n * 8) for i in range(len(raw) // (n * 8)))
        return {self._key(spec, row[:-1]): MapSlot(row[-1]) for row in rows if row[-1]}

    @staticmethod
    def _key(spec: KeySpec, words: tuple[int, ...]) -> MapKey:
        """The toy's key parts: a comm's two words as text, a pid's low 32 bits signed."""
        it, out = iter(words), list[int | str]()
        for part in spec.parts:
            if part.kind == "comm":
                out.append(struct.pack("<QQ", next(it), next(it)).split(b"\0")[0].decode(errors="replace"))
            elif part.kind == "pid":
                low = next(it) & 0xFFFFFFFF
                out.append(low - (1 << 32) if low >> 31 else low)
            else:
                out.append(next(it))
        return tuple(out)


class ToyTraps:
    """The toy's one vector (arm64's el1h_64_sync), where every exception stops: its syndrome says which."""

    trap_entries = ("toy_el1h_sync",)
    trap_path: tuple[str, ...] = ()

    def kprobe_break_hook(self, regs: Mapping[str, int]) -> BreakHook | None:
        """arm64's call_break_hook for kprobes' two immediates: any other exception, or a BRK of another
        immediate, is the toy kernel's."""
        esr = regs["esr"]
        if esr >> EC_SHIFT != EC_BRK64:
            return None
        return {KPROBES_BRK_IMM: BreakHook.KPROBE, KPROBES_BRK_SS_IMM: BreakHook.KPROBE_SS}.get(esr & BRK_IMM_MASK)

    def decode_trap(self, hook: TrapHook, regs: Mapping[str, int], read: Callable[[int, int], bytes]) -> Trap:
        addr, flags = regs["elr"], regs["spsr"]
        return Trap(addr, regs["sp"], flags, {**regs, "pc": addr, "psr": flags}, user=bool(flags & USER))


class ToyBoot:
    """The toy kernel is always up: nothing boots."""

    def boot_stage(self, regs: Mapping[str, int]) -> BootStage:
        return BootStage.KERNEL  # the toy kernel is always up

    def arch_boot_entry(self, read: Callable[[int, int], bytes], address: Callable[[str], int]) -> int:
        raise SymbolError("the toy kernel does not boot")

    def arch_boot_switch(self, read: Callable[[int, int], bytes], address: Callable[[str], int]) -> int | None:
        return None


class Toy:
    """The toy ISA's answers to everything the core asks (qprobe.arch.Arch): no jump optimization."""

    name = "toy"
    breakpoint = BRK
    slot_size = 32
    registers = RegisterLayout(
        gdb_name={
            "ip": "pc",
            "sp": "sp",
            "flags": "psr",
            "r0": "r0",
            "r1": "r1",
            "r2": "r2",
            "r3": "r3",
            "lr": "lr",
            "elr": "elr",
            "spsr": "spsr",
        },
        system=("esr",),  # the syndrome kprobe_break_hook reads, as arm64's ESR_EL1
        arg_regs=("r0", "r1", "r2", "r3"),
        defaults={},
        general=("r0", "r1", "r2", "r3"),
        irq_flag=IRQ,
        page_table="ttbr",
        percpu_base="tpidr",
        current="cur",  # current in a register in kernel mode, as arm64's SP_EL0
        retval="r0",
        stack_args=0,
        current_percpu="entry_task",  # and in a per-CPU variable at a user-mode stop, as arm64's __entry_task
    )
    gdb_architecture = "toy"
    drgn_architecture = "UNKNOWN"
    kprobe_ip_offset = 0  # the trapped pc is the probe's own, as on arm64
    ftrace_site = None  # the toy kernel has no ftrace
    traps = ToyTraps()
    boot = ToyBoot()
    # The facets: the toy has no jump optimization, so every probe stays a breakpoint.
    trap_step: ToyTrapStep | None = ToyTrapStep()
    elr_writable = True  # arm64's ELR_EL1 is not, through QEMU 7.2's stub
    trap_watch = None  # no watchpoint hook: the dispatcher breaks on the entry
    optprobes = None
    guest_ram = ToyGuestRam()
    uprobes = ToyUprobes()
    cycle_counter = None
    guest_call = None
    jump_label_probe = 4
    jump_label_max = 4
    static_call_size = 4

    def page_tables(self, regs: Mapping[str, int]) -> Any:
        raise AssertionError("the toy target's memory is flat: nothing walks its page tables")

    def vmcoreinfo(self, address: Callable[[str], int], virt_to_phys: Callable[[int], int],
                   read_u64: Callable[[int], int], paging: PageTables) -> list[str]:  # fmt: skip
        return []

    def jump_label_size(self, code: bytes) -> int:
        return 4

    # -- instructions ----------------------------------------------------------------------
    def arch_adjust_kprobe_addr(self, func_code: bytes, func_start: int, offset: int) -> int:
        return func_start + (self.entry_skip(func_code) if offset == 0 else offset)

    def entry_skip(self, func_code: bytes) -> int:
        return 4 if func_code[:1] == bytes([BTI]) else 0

    def check_boundary(self, code: bytes, func_start: int, addr: int, patched: Mapping[int, int], name: str) -> None:
        if (addr - func_start) % 4:
            raise InvalidProbe(f"{name}+{addr - func_start:#x} is not on an instruction boundary (EILSEQ)")

    def arch_prepare_kprobe(
        self, code: bytes, addr: int, slot: int, where: str, exception_table: object
    ) -> ToyPrepared:
        op = code[0]
        if op not in (NOP, ADDI, LDR, BTI):
            raise InvalidProbe(f"{where}: cannot probe instruction {code[:4].hex()} (EINVAL)")
        emulate = "nop" if op in (NOP, BTI) else None
        step = "it reads the stack" if op == LDR else None
        return ToyPrepared(addr, slot, bytes(code[:4]), emulate, op == ADDI, step)

    def arch_slot_code(self, prep: Prepared) -> bytes:
        boosted = prep.copy + insn(JMPL) + (prep.addr + 4).to_bytes(8, "little")
        return boosted + prep.copy + BRK_SS

    def arch_setup_resume(self, prep: Prepared, regs: Any, mem: Memory, may_boost: bool,
                          may_trap_step: bool) -> Resume:  # fmt: skip
        changed = regs.dirty()  # what the handlers wrote goes with the resume
        if prep.emulate is not None:
            regs.set_quietly("ip", prep.addr + 4)
            return Resume(ResumeKind.CONTINUE, prep.addr + 4, changed=changed)
        if may_boost and prep.boostable:
            return Resume(ResumeKind.BOOST, prep.slot_addr, changed=changed, jump_back=prep.addr + 4)
        if may_trap_step and prep.step_reason is None:
            return Resume(ResumeKind.TRAP_STEP, prep.slot_addr + STEP_COPY, flags=regs.flags & ~IRQ,
                          changed=changed)  # fmt: skip
        return Resume(ResumeKind.STEP, prep.slot_addr + STEP_COPY, flags=regs.flags, changed=changed)

    def arch_slot_resume(self, slot: int, addr: int, ip: int, flags: int) -> tuple[int, int] | None:
        copy = slot + STEP_COPY
        return (addr + ip - copy, flags | IRQ) if copy <= ip <= copy + 4 else None

    def step_left_slot(self, prep: Prepared, ip: int) -> bool:
        return ip != prep.slot_addr + STEP_COPY + 4

    def arch_resume_singlestep(self, prep: Prepared, regs: Any, mem: Memory) -> None:
        regs.set_quietly("ip", regs.ip - prep.slot_addr - STEP_COPY + prep.addr)

    def arch_emulate_in_place(self, regs: Any, mem: Memory) -> bool:
        if mem.read(regs.ip, 1)[0] != NOP:
            return False
        regs.ip += 4
        return True

    def arch_fault_fixup(self, prep: Prepared, regs: Any, mem: Memory) -> bool:
        copy = prep.slot_addr + STEP_COPY  # arm64's way: the exception's return address is a register
        if not copy <= regs.elr <= copy + 4:
            return True
        if self.elr_writable:
            regs.elr = prep.addr + regs.elr - copy
            return True
        back = self.arch_slot_resume(prep.slot_addr, prep.addr, regs.elr, regs.spsr)
        assert back is not None
        regs.ip, regs.flags = back  # to take the exception again at the probe
        return False

    # -- traps ---------------------------------------------------------------------------
    def resume_registers(self, resume: Resume) -> dict[str, int]:
        out = {"pc": resume.ip}
        if resume.sp is not None:
            out["sp"] = resume.sp
        if resume.flags is not None:
            out["psr"] = resume.flags
        return {**out, **resume.changed}

    def ip(self, regs: Mapping[str, int]) -> int:
        return regs["pc"]

    ret_pops = 0  # RET leaves sp as it is

    def arch_prepare_kretprobe(self, regs: Any, read_u64: Callable[[int], int]) -> ReturnHijack:
        return ReturnHijack(regs.lr, register="lr")  # the caller's call put the return address in lr

    def sp(self, regs: Mapping[str, int]) -> int:
        return regs["sp"]

    def flags(self, regs: Mapping[str, int]) -> int:
        return regs["psr"]

    def user_mode(self, regs: Mapping[str, int]) -> bool:
        return bool(regs["psr"] & USER)

    def percpu_base(self, regs: Mapping[str, int]) -> int:
        return regs.get("tpidr", 0)

    # -- the blacklist ---------------------------------------------------------------------
    def arch_populate_kprobe_blacklist(self) -> ArchBlacklist:
        return ArchBlacklist(sections=(("__entry_text_start", "__entry_text_end", ".entry.text"),))

    def arch_kretprobe_blacklist(self) -> frozenset[str]:
        return frozenset({"toy_noreturn"})


# -- the target ---------------------------------------------------------------------------


class ToyMemory:
    """Guest RAM as one bytearray, and the virtual mappings of the toy kernel (GuestMemory and SharedRam).

    The kernel's regions are in every address space; user pages are per page-table root (the value of
    ``ttbr``, which is its own pgd), each a frame of RAM from USER_PHYS on.
    """

    pgd = 0
    writable = True
    REGIONS = ((TEXT, TEXT_SIZE, TEXT_PHYS), (SCRATCH, SCRATCH_SIZE, SCRATCH_PHYS), (STACK, STACK_SIZE, STACK_PHYS))

    def __init__(self) -> None:
        self.ram = bytearray(RAM_SIZE)
        self.user: dict[int, dict[int, int]] = {}  # page-table root -> user page number -> its frame's address

    def pgd_of(self, root: int) -> int:
        return root

    def map_user(self, root: int, addr: int, frame: int) -> None:
        """Make the page at ``addr`` present in address space ``root``, on the frame at ``frame``."""
        assert USER_PHYS <= frame < RAM_SIZE and frame % PAGE == 0 and root
        self.user.setdefault(root, {})[addr // PAGE] = frame

    def unmap_user(self, root: int, addr: int) -> None:
        self.user.get(root, {}).pop(addr // PAGE, None)

    def virt_to_phys(self, addr: int, pgd: int | None = None) -> int:
        for base, size, phys in self.REGIONS:
            if base <= addr < base + size:
                return phys + addr - base
        frame = self.user.get(pgd or 0, {}).get(addr // PAGE)
        if frame is None:
            raise MemoryFault(addr)
        return frame + addr % PAGE

    def leaf(self, addr: int, pgd: int) -> tuple[int, int, int]:
        """A user page's entry is TOY_USER_PAGE: the toy's user pages allow every access."""
        phys = self.virt_to_phys(addr, pgd)
        return phys, PAGE, TOY_USER_PAGE if addr < USER_END else 0

    def user_end(self) -> int:
        return USER_END

    def read(self, addr: int, size: int, pgd: int | None = None) -> bytes:
        phys = self.virt_to_phys(addr, pgd)
        self.virt_to_phys(addr + size - 1, pgd)
        return bytes(self.ram[phys : phys + size])

    def read_u64(self, addr: int, pgd: int | None = None) -> int:
        return int.from_bytes(self.read(addr, 8, pgd), "little")

    def write(self, addr: int, data: bytes) -> None:
        self.write_phys(self.virt_to_phys(addr), data)

    def read_phys(self, phys: int, size: int) -> bytes:
        if not 0 <= phys <= phys + size <= RAM_SIZE:
            raise MemoryFault(phys, "outside guest RAM")
        return bytes(self.ram[phys : phys + size])

    def write_phys(self, phys: int, data: bytes) -> None:
        if not 0 <= phys <= phys + len(data) <= RAM_SIZE:
            raise MemoryFault(phys, "outside guest RAM")
        self.ram[phys : phys + len(data)] = data

    def read_u64_phys(self, phys: int) -> int:
        return int.from_bytes(self.read_phys(phys, 8), "little")

    def write_u64_phys(self, phys: int, value: int) -> None:
        self.write_phys(phys, value.to_bytes(8, "little"))


class ToyCpu:
    """vCPUs executing the toy ISA, seen through the gdbstub interface (GdbTransport)."""

    running = False
    stack_return = False  # RET pops the return address off the stack (ToyStackReturn's convention)

    def __init__(self, mem: ToyMemory, ncpus: int = 2) -> None:
        self.mem = mem
        self.regs = {f"p1.{i + 1}": {"pc": TEXT, "sp": STACK + STACK_SIZE - 0x100, "psr": IRQ, "r0": 0, "r1": 0,
                                     "r2": 0, "r3": 0, "lr": 0, "elr": 0, "spsr": 0, "esr": 0, "ttbr": 0,
                                     "tpidr": 0, "cur": 0}
                     for i in range(ncpus)}  # fmt: skip
        self.breakpoints: list[tuple[int, int, int]] = []  # (addr, kind, length) as inserted
        self.steps: list[tuple[str, int]] = []  # (vCPU, pc) of every step
        self.written: list[tuple[str, dict[str, int]]] = []
        self.phys = False

    def handshake(self) -> StopReply:
        return StopReply("T", 5, "p1.1", ())

    def threads(self) -> list[str]:
        return list(self.regs)

    def read_registers(self, tid: str) -> dict[str, int]:
        return dict(self.regs[tid])

    def write_registers(self, tid: str, values: dict[str, int]) -> None:
        self.written.append((tid, dict(values)))
        self.regs[tid].update(values)

    def set_physical(self, on: bool) -> None:
        self.phys = on

    def read_memory(self, addr: int, size: int) -> bytes:
        return self.mem.read_phys(addr, size) if self.phys else self.mem.read(addr, size)

    def write_memory(self, addr: int, data: bytes) -> None:
        if self.phys:
            self.mem.write_phys(addr, data)
        else:
            self.mem.write(addr, data)

    def insert_breakpoint(self, addr: int, kind: int = 0, length: int = 1) -> None:
        self.breakpoints.append((addr, kind, length))

    def remove_breakpoint(self, addr: int, kind: int = 0, length: int = 1) -> None:
        self.breakpoints.remove((addr, kind, length))  # ValueError for one never inserted, as the stub's E22

    def cont(self) -> None:
        raise AssertionError("the toy target never runs freely: tests drive each instruction")

    def step(self, tid: str, timeout: float = 10.0) -> StopReply:
        regs = self.regs[tid]
        self.steps.append((tid, regs["pc"]))
        self.execute(tid)
        return StopReply("T", 5, tid, ())

    def execute(self, tid: str) -> None:
        """Run one instruction of ``tid``.  An exception (a BRK, an undefined instruction, an access to memory
        that is not mapped: the instruction not run) enters ENTRY, its address in ``elr``, its kind in ``esr``."""
        regs = self.regs[tid]
        pgd = regs["ttbr"] if regs["psr"] & USER else 0
        try:
            self._execute(tid, dict(regs), pgd)  # on a copy: a faulting instruction changes nothing
        except MemoryFault:
            self.exception(regs, (EC_DABT_LOW if regs["psr"] & USER else EC_DABT_CUR) << EC_SHIFT)
            return
        self._execute(tid, regs, pgd)

    @staticmethod
    def exception(regs: dict[str, int], esr: int) -> None:
        """Take an exception with syndrome ``esr`` at the instruction at pc: to the vector, interrupts off."""
        regs.update(elr=regs["pc"], spsr=regs["psr"], esr=esr, pc=ENTRY, psr=regs["psr"] & ~(USER | IRQ))

    def _execute(self, tid: str, regs: dict[str, int], pgd: int) -> None:
        pc = regs["pc"]
        op, imm = self.mem.read(pc, 1, pgd)[0], int.from_bytes(self.mem.read(pc + 1, 3, pgd), "little")
        if op == BRK_OP:
            self.exception(regs, EC_BRK64 << EC_SHIFT | imm & BRK_IMM_MASK)
            return
        if op == UNDEF:
            self.exception(regs, EC_UNKNOWN << EC_SHIFT)
            return
        if op == ADDI:
            regs["r0"] = (regs["r0"] + imm) & ((1 << 64) - 1)
        elif op == LDR:
            regs["r1"] = self.mem.read_u64(regs["sp"], pgd)
        elif op == JMPL:
            regs["pc"] = self.mem.read_u64(pc + 4, pgd)
            return
        elif op == RET:
            if self.stack_return:
                regs["pc"], regs["sp"] = self.mem.read_u64(regs["sp"], pgd), regs["sp"] + 8
            else:
                regs["pc"] = regs["lr"]
            return
        elif op not in (NOP, BTI):
            raise AssertionError(f"toy vCPU {tid} executed {op:#x} at {pc:#x}")
        regs["pc"] = pc + 4

    def interrupt(self) -> None:
        pass

    def wait_stop(self, timeout: float | None = 10.0) -> StopReply:
        return StopReply("T", 2, "p1.1", ())

    def poll_stop(self, timeout: float, wake: int | None = None) -> StopReply | None:
        return None

    def detach(self) -> None:
        pass

    def close(self) -> None:
        pass


class ToyJournal:
    """The undo journal: what it holds, by physical address (as qprobe.vmm.journal.Journal, in memory)."""

    def __init__(self) -> None:
        self.patches: dict[int, Patch] = {}
        self.meta: dict[str, int] = {}
        self.batches = 0

    def record(self, patch: Patch) -> None:
        self.patches[patch.phys] = patch

    def forget(self, phys: int) -> None:
        self.patches.pop(phys, None)

    record_often = record
    forget_often = forget

    def set_meta(self, **values: int) -> None:
        self.meta.update(values)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        self.batches += 1
        yield


class ToyMachine(Machine):
    """Machine's guarded writes over the toy target, with no stop loop: ``call`` runs in the caller's thread."""

    def __init__(self, cpu: ToyCpu, mem: ToyMemory) -> None:  # no thread: the test is the stop loop
        self.gdb = cpu  # type: ignore[assignment]
        self.mem = mem  # type: ignore[assignment]
        self.journal = ToyJournal()  # type: ignore[assignment]
        self.vcpus = cpu.threads()
        self.pc = "pc"
        self.stop_handlers = {}
        self.watch_handlers = {}
        self.after_stop = None
        self.patch_watchers = []
        self.data_writer = None

    def call(self, fn: Callable[[], Any], timeout: float | None = 60.0) -> Any:
        return fn()

    def patch_data(self, virt: int, data: bytes, what: str) -> Patch:
        p = Patch(self.mem.virt_to_phys(virt), virt, self.mem.read(virt, len(data)), data, what)
        self.journal.record_often(p)
        self.mem.write(virt, data)
        return p

    def write_phys(self, phys: int, data: bytes) -> None:
        self.mem.write_phys(phys, data)


class ToyScratch:
    """The scratch area: first-fit allocations in [SCRATCH, SCRATCH + SCRATCH_SIZE), bounded."""

    base = SCRATCH
    GRANULE = 16
    size = SCRATCH_SIZE

    def __init__(self, machine: ToyMachine) -> None:
        self.machine = machine
        self.mapped = False
        self.maps = 0
        self.allocs: dict[int, int] = {}  # address -> size

    def map(self) -> int:
        self.mapped = True
        self.maps += 1
        return self.base

    def ensure_mapped(self) -> None:
        if not self.mapped:
            self.map()

    def unmap(self) -> None:
        self.mapped = False
        self.allocs.clear()

    @property
    def mapped_size(self) -> int:
        return SCRATCH_SIZE

    @property
    def used(self) -> int:
        return sum(self.allocs.values())

    def contains(self, addr: int) -> bool:
        return self.mapped and self.base <= addr < self.base + SCRATCH_SIZE

    def alloc(self, size: int, align: int = GRANULE) -> int:
        assert self.mapped, "alloc before map"
        size = -(-size // self.GRANULE) * self.GRANULE
        at = self.base
        for start, length in sorted(self.allocs.items()):
            at = -(-at // align) * align
            if at + size <= start:
                break
            at = max(at, start + length)
        at = -(-at // align) * align
        if at + size > self.base + SCRATCH_SIZE:
            raise ProbeError(f"qprobe's scratch area is full ({size} bytes wanted)")
        self.allocs[at] = size
        return at

    def free(self, addr: int) -> None:
        del self.allocs[addr]

    def phys_of(self, addr: int) -> int:
        return SCRATCH_PHYS + addr - self.base

    def write(self, addr: int, data: bytes) -> None:
        self.machine.write_phys(self.phys_of(addr), data)

    @contextlib.contextmanager
    def combined(self) -> Iterator[None]:
        yield


@dataclass
class ToySymbols:
    """The toy kernel's symbols: sized functions laid out in TEXT, and markers."""

    functions: list[Symbol] = field(default_factory=list)
    markers: dict[str, int] = field(default_factory=dict)
    modules: dict[str, object] = field(default_factory=dict)  # no module is ever loaded
    slide = 0

    def add(self, name: str, code: bytes, at: int | None = None) -> int:
        """A function of ``code`` at ``at`` (else after the last one), written into ``mem`` by ToyTarget."""
        addr = at if at is not None else max((f.addr + f.size for f in self.functions), default=TEXT + 0x1000)
        self.functions.append(Symbol(name, addr, len(code), "func"))
        return addr

    def __contains__(self, name: str) -> bool:
        return name in self.markers or any(f.name == name for f in self.functions)

    def address(self, name: str) -> int:
        if name in self.markers:
            return self.markers[name]
        return self.lookup(name).addr

    def lookup(self, name: str) -> Symbol:
        for f in self.functions:
            if f.name == name:
                return f
        raise SymbolError(f"no symbol {name!r}")

    def containing(self, addr: int) -> Symbol | None:
        return next((f for f in self.functions if f.addr <= addr < f.addr + f.size), None)

    def function(self, addr: int) -> Symbol | None:
        return self.containing(addr)

    def is_text(self, addr: int) -> bool:
        return TEXT <= addr < TEXT + TEXT_SIZE

    def symbolize(self, addr: int) -> str:
        f = self.containing(addr)
        return f"{f.name}+{addr - f.addr:#x}" if f else f"{addr:#x}"

    def names(self) -> list[str]:
        return [f.name for f in self.functions] + list(self.markers)

    def kallsyms_size(self, sym: Symbol) -> int:
        return sym.size

    def ftrace_site(self, addr: int, site: Any, entry: int) -> bool:
        return False

    def exception_table(self) -> None:
        return None

    def module_of(self, addr: int) -> None:
        return None  # no modules: vmlinux only


class _NoProgram:
    def type(self, name: str) -> object:
        raise LookupError(f"the toy kernel has no debug info ({name})")

    def __getitem__(self, name: str) -> object:
        raise LookupError(f"the toy kernel has no debug info ({name})")

    def variable(self, name: str) -> object:
        raise LookupError(f"the toy kernel has no debug info ({name})")


class ToyObject:
    """A drgn Object as the core reads a pointer: its ``value_()``, and members as attributes."""

    def __init__(self, value: int, **members: ToyObject) -> None:
        self._value = value
        self.__dict__.update(members)

    def value_(self) -> int:
        return self._value


@dataclass
class ToyKernel:
    """KernelData as the core reads it: symbols, memory, no debug info, ``current`` in the register ``cur``."""

    symbols: ToySymbols
    mem: ToyMemory
    prog: _NoProgram = field(default_factory=_NoProgram)
    mms: dict[int, int] = field(default_factory=dict)  # task -> its mm (0: a kernel thread)

    def current_address(self, regs: Mapping[str, int], read_u64: Callable[[int], int] | None = None) -> int:
        return regs["cur"]  # the toy's RegisterLayout.current: a KeyError if a caller brings only the per-CPU base

    def current(self, regs: Mapping[str, int]) -> ToyObject:
        return self.task(self.current_address(regs))

    def task(self, addr: int) -> ToyObject:
        return ToyObject(addr, mm=ToyObject(self.mms.get(addr, 0)))

    def snapshot(self, task: int | None = None, *, regs: Mapping[str, int] | None = None) -> Any:
        return SimpleNamespace(task=self.current_address(regs or {}) if task is None else task)

    def type_offset(self, struct_name: str, member: str) -> int:
        raise LookupError(f"the toy kernel has no debug info ({struct_name})")


class ToyTarget:
    """One toy guest: memory, vCPUs, machine, symbols (the #BP entry and an entry-text section) and scratch."""

    def __init__(self, ncpus: int = 2) -> None:
        self.mem = ToyMemory()
        self.cpu = ToyCpu(self.mem, ncpus)
        self.machine = ToyMachine(self.cpu, self.mem)
        self.symbols = ToySymbols()
        # The vector kernel.features finds by ToyTraps.trap_entries, and the entry text it is in.
        self.symbols.markers.update({"toy_el1h_sync": ENTRY, "__entry_text_start": TEXT + 0x100,
                                     "__entry_text_end": TEXT + 0x200})  # fmt: skip
        self.kernel = ToyKernel(self.symbols, self.mem)
        self.scratch = ToyScratch(self.machine)

    def function(self, name: str, *code: bytes) -> int:
        """Define a function of these instructions; its address."""
        text = b"".join(code)
        addr = self.symbols.add(name, text)
        self.mem.write(addr, text)
        return addr

    def regs(self, tid: str) -> dict[str, int]:
        return self.cpu.regs[tid]


class ToyStackReturn(Toy):
    """The toy with x86's return convention: the call pushes the return address, RET pops it."""

    ret_pops = 8

    def arch_prepare_kretprobe(self, regs: Any, read_u64: Callable[[int], int]) -> ReturnHijack:
        return ReturnHijack(read_u64(regs.sp), slot=regs.sp)


class Rig:
    """A toy target with a KprobeManager on it, the functions the tests probe, and a way to run its vCPUs.

    The toy kernel has no ``bp_desc``, so the dispatcher hooks traps with a breakpoint on ENTRY, where every
    exception stops.
    Its functions return through ``lr``, or with ``stack_return`` through a return address on the stack.
    """

    def __init__(self, stack_return: bool = False) -> None:
        self.t = ToyTarget()
        self.t.cpu.stack_return = stack_return
        self.fn = self.t.function("toy_fn", insn(BTI), insn(NOP), insn(ADDI, 5), insn(LDR), insn(NOP))
        self.other = self.t.function("toy_other", insn(ADDI, 7), insn(NOP))
        self.bad = self.t.function("toy_bad", bytes(4), insn(NOP))
        self.load = self.t.function("toy_load", insn(LDR), insn(NOP))
        self.t.symbols.add("toy_entry", insn(NOP) * 4, at=ENTRY)  # inside the entry-text section
        self.t.mem.write(ENTRY, insn(NOP) * 4)
        arch = ToyStackReturn() if stack_return else Toy()
        regs = RegsMaker(self.t.machine, self.t.kernel, arch)  # type: ignore[arg-type]
        self.km = KprobeManager(self.t.machine, self.t.kernel, self.t.scratch, arch, ProbeTable(), regs)  # type: ignore[arg-type]
        self.text = bytes(self.t.mem.ram[TEXT_PHYS : TEXT_PHYS + TEXT_SIZE])

    def text_unchanged(self) -> bool:
        return bytes(self.t.mem.ram[TEXT_PHYS : TEXT_PHYS + TEXT_SIZE]) == self.text

    def at(self, addr: int) -> bytes:
        return self.t.mem.read(addr, 4)

    def run(self, tid: str, pc: int, **regs: int) -> None:
        """Put ``tid`` at ``pc`` with interrupts on and ``regs`` set, and execute one instruction (``step``)."""
        cpu = self.t.regs(tid)
        cpu.update(pc=pc, psr=IRQ, **regs)
        self.step(tid)

    def step(self, tid: str) -> None:
        """Execute one instruction of ``tid``; an exception goes to the dispatcher as the stop loop sends it."""
        self.t.cpu.execute(tid)
        regs = self.t.regs(tid)
        if regs["pc"] == ENTRY:
            self.km.dispatcher.on_entry_stop(tid, dict(regs))


__all__ = [
    "Rig",
    "Toy",
    "ToyCpu",
    "ToyGuestRam",
    "ToyMachine",
    "ToyMemory",
    "ToyScratch",
    "ToyStackReturn",
    "ToySymbols",
    "ToyTarget",
    "insn",
]
