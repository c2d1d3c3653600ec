"""User-space probes (qprobe.core.uprobes) on the toy architecture.

A ``World`` is the guest's side that ``UserFiles`` reads through drgn: files with their page cache,
processes (a task, an mm, a page-table root, a per-CPU base) and their vmas mapping files at offsets.
Its pages are real toy memory, so a stop reads the instruction the process has and a step runs it.
``stop`` is what the stop loop does when a vCPU stops on a stub breakpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fakearch import (
    ADDI,
    BRK,
    ENTRY,
    IRQ,
    LDR,
    NOP,
    PAGE,
    RAM_SIZE,
    TEXT_PHYS,
    TEXT_SIZE,
    USER,
    USER_PHYS,
    Rig,
    insn,
)
from ifunc_library import ifunc_library

from qprobe.core.regs import PtRegs
from qprobe.core.uprobe import Uprobe, Uretprobe
from qprobe.core.uprobes import MMAP_HOOK, UprobeManager
from qprobe.core.ureturns import MAX_URETPROBE_DEPTH
from qprobe.errors import InvalidProbe, MemoryFault
from qprobe.kernel.ufile import VM_MAYEXEC, VM_MAYSHARE, VM_WRITE, GuestFile, Mapping
from qprobe.kernel.userelf import UserElf
from qprobe.vmm.gdbremote import BREAK_HW

A, B = "p1.1", "p1.2"
PROG, LIB = "/usr/bin/prog", "/usr/lib/libother.so"
# The probed file: page 0 a header, page 1 text.  FUNC is a function; CALLER and SITE are where its
# callers continue (the outer one, and its own recursive call); AGAIN another call site in FUNC.
FUNC, LOAD, SITE, AGAIN, CALLER, TRAP = 0x1000, 0x1004, 0x1010, 0x1018, 0x1020, 0x1030
BASE = 0x40_0000  # where processes map the file, unless a test says otherwise
STACK_TOP = 0x7FF0_0000  # a process's stack page is [STACK_TOP - PAGE, STACK_TOP)


def _text(first: int) -> bytes:
    """Two pages: a header of NOPs, then text whose first instruction is ``ADDI first``."""
    code = {FUNC: insn(ADDI, first), LOAD: insn(LDR), TRAP: BRK}
    return b"".join(code.get(off, insn(NOP)) for off in range(0, 2 * PAGE, 4))


@dataclass(frozen=True)
class Proc:
    """A task of a process: its task_struct, the mm, the page-table root, the per-CPU base it runs on."""

    task: int
    mm: int
    root: int
    percpu: int


class World:
    """The guest's files, page cache and processes, as the manager's ``UserFiles`` answers for them."""

    page_size = PAGE

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.files: dict[str, GuestFile] = {}
        self.data: dict[int, bytes] = {}  # address_space -> the file's bytes
        self.cache: dict[tuple[int, int], int] = {}  # (address_space, index) -> its page-cache frame
        self.owners: dict[int, tuple[int, int]] = {}  # pfn -> (address_space, index): page-cache frames only
        self.vmas: dict[int, tuple[Mapping, int | None]] = {}  # vma -> its mapping, its file (None: anonymous)
        self.roots: dict[int, int] = {}  # mm -> its page-table root
        self.frames = iter(range(USER_PHYS, RAM_SIZE, PAGE))
        self.nprocs = 0

    # -- building the guest ----------------------------------------------------------------------
    def file(self, path: str, data: bytes) -> GuestFile:
        n = len(self.files) + 1
        f = GuestFile(path, 0x1_0000 * n, 0x1_0000 * n + 0x100, len(data), n, 1)
        self.files[path], self.data[f.mapping] = f, data
        for index in range(-(-len(data) // PAGE)):
            frame = self.frame(data[index * PAGE : (index + 1) * PAGE])
            self.cache[(f.mapping, index)] = frame
            self.owners[frame // PAGE] = (f.mapping, index)
        return f

    def frame(self, data: bytes) -> int:
        frame = next(self.frames)
        self.rig.t.mem.write_phys(frame, data.ljust(PAGE, b"\0"))
        return frame

    def process(self) -> Proc:
        """A process with a stack page, running on its own per-CPU base."""
        self.nprocs += 1
        n = self.nprocs
        p = Proc(task=0xFFFF_9000_0000_0000 + n * 0x1000, mm=0xFFFF_9100_0000_0000 + n * 0x1000,
                 root=n * 0x10_0000, percpu=n * 0x100)  # fmt: skip
        self.roots[p.mm] = p.root
        self.rig.t.mem.map_user(p.root, STACK_TOP - PAGE, self.frame(b""))
        return self.thread(p, p.task)

    def thread(self, p: Proc, task: int) -> Proc:
        """A task of ``p``'s process (``task`` its own), on its own per-CPU base."""
        t = Proc(task, p.mm, p.root, p.percpu if task == p.task else p.percpu + 0x10)
        self.rig.t.kernel.mms[task] = p.mm
        return t

    def map(self, p: Proc, start: int, path: str | None, file_start: int = 0, pages: int = 2,
            flags: int = VM_MAYEXEC, present: bool = True, private: bool = False) -> int:  # fmt: skip
        """A vma of ``p``: ``pages`` of file ``path`` from ``file_start`` (None: anonymous memory of ``_text``
        bytes); its pages present, on the page cache's frames or on private copies.  The vma's address."""
        m = Mapping(p.mm, start, start + pages * PAGE, file_start, flags)
        space = self.files[path].mapping if path is not None else None
        vma = 0xFFFF_9200_0000_0000 + len(self.vmas) * 0x100
        self.vmas[vma] = (m, space)
        for i in range(pages if present else 0):
            index = file_start // PAGE + i
            if space is None or private:
                data = self.data[space][index * PAGE : (index + 1) * PAGE] if space is not None else _text(9)[PAGE:]
                frame = self.frame(data)
            else:
                frame = self.cache[(space, index)]
            self.rig.t.mem.map_user(p.root, start + i * PAGE, frame)
        return vma

    def fault_in(self, p: Proc, addr: int) -> None:
        """The kernel handles a fault on ``addr``: the page-cache page there becomes present."""
        m, space = next((m, s) for m, s in self.vmas.values() if m.mm == p.mm and m.start <= addr < m.end)
        assert space is not None
        index = (m.file_start + addr - m.start) // PAGE
        self.rig.t.mem.map_user(p.root, addr, self.cache[(space, index)])

    def unmap(self, vma: int) -> None:
        m, _space = self.vmas.pop(vma)
        for page in range(m.start, m.end, PAGE):
            self.rig.t.mem.unmap_user(self.roots[m.mm], page)

    # -- UserFiles -----------------------------------------------------------------------------------
    def lookup(self, path: str) -> GuestFile | None:
        return self.files.get(path)

    def read(self, f: GuestFile, offset: int, size: int) -> bytes | None:
        return self.data[f.mapping][offset : offset + size]

    def mappings(self, f: GuestFile) -> list[Mapping]:
        return [m for m, space in self.vmas.values() if space == f.mapping]

    def mapping_at(self, mm: int, addr: int) -> tuple[Mapping, int] | None:
        for m, space in self.vmas.values():
            if m.mm == mm and m.start <= addr < m.end:
                return (m, space) if space is not None else None
        return None

    def vma_mapping(self, vma: int) -> tuple[Mapping, int] | None:
        m, space = self.vmas[vma]
        return (m, space) if space is not None else None

    def page_owner(self, pfn: int) -> tuple[int, int] | None:
        return self.owners.get(pfn)

    def read_user(self, mm: int, addr: int, size: int) -> bytes | None:
        try:
            return self.rig.t.mem.read(addr, size, self.roots[mm])
        except MemoryFault:
            return None

    def still_there(self, f: GuestFile) -> bool:
        return self.files.get(f.path) == f

    def reuse(self, path: str, new_path: str) -> GuestFile:
        """``path`` deleted and freed, and a new file at ``new_path`` whose inode took its memory (another ino)."""
        old = self.files.pop(path)
        f = GuestFile(new_path, old.inode, old.mapping, old.size, old.ino + 100, old.generation + 1)
        self.files[new_path] = f
        return f


@dataclass
class Setup:
    rig: Rig
    world: World
    um: UprobeManager
    hook: int  # the address of the toy kernel's vma_set_page_prot

    def bps(self) -> list[int]:
        """The addresses of the stub breakpoints in (the dispatcher's own on the trap entry aside)."""
        stubs = sorted(addr for addr, kind, length in self.rig.t.cpu.breakpoints
                       if (kind, length) == (BREAK_HW, 1) and addr != ENTRY)  # fmt: skip
        assert sorted(set(self.rig.t.machine.stop_handlers) - {ENTRY}) == stubs
        return stubs

    def stop(self, p: Proc, addr: int, sp: int = STACK_TOP - 0x100, tid: str = A, **regs: int) -> dict[str, int]:
        """The VM stopped with vCPU ``tid`` running ``p`` in user mode on ``addr``: what the stop loop does."""
        cpu = self.rig.t.regs(tid)
        cpu.update(pc=addr, sp=sp, psr=USER | IRQ, ttbr=p.root, tpidr=p.percpu, cur=p.task, **regs)
        self.rig.t.machine.stop_handlers[addr](tid, dict(cpu))
        return cpu

    def mmap_hook(self, vma: int) -> None:
        """mmap_region() calls vma_set_page_prot(vma) on a vCPU in kernel mode (the hook's int3 is there)."""
        assert self.rig.at(self.hook) == BRK
        self.rig.run(B, self.hook, r0=vma)
        assert self.rig.t.regs(B)["pc"] == self.hook + 4


@pytest.fixture
def s() -> Iterator[Setup]:
    rig = Rig()
    hook = rig.t.function(MMAP_HOOK, insn(NOP), insn(NOP))
    rig.text = bytes(rig.t.mem.ram[TEXT_PHYS : TEXT_PHYS + TEXT_SIZE])  # with the hook's function in it
    km = rig.km
    um = UprobeManager(rig.t.machine, km.arch, rig.t.kernel, km, km.handlers, km.regs, km.dispatcher)  # type: ignore[arg-type]
    world = World(rig)
    um._files = world  # type: ignore[assignment]
    world.file(PROG, _text(1))
    world.file(LIB, _text(2))
    yield Setup(rig, world, um, hook)
    um.remove_all()
    assert rig.t.cpu.breakpoints == [] and rig.t.machine.stop_handlers == {} and um.hook is None
    assert rig.text_unchanged() and rig.km.addresses() == []


def _push(s: Setup, p: Proc, sp: int, ret: int) -> int:
    """A call: the toy pushes the return address, a word at ``sp``."""
    phys = s.rig.t.mem.virt_to_phys(sp, p.root)
    s.rig.t.mem.write_phys(phys, ret.to_bytes(4, "little"))
    return sp


# -- where: registration, new mappings, unregistration ------------------------------------------------


def test_registration_arms_every_probeable_mapping_of_the_offset(s: Setup) -> None:
    p1, p2, p3 = s.world.process(), s.world.process(), s.world.process()
    s.world.map(p1, BASE, PROG)
    s.world.map(p2, 0x50_0000, PROG, file_start=PAGE, pages=1)  # the text page alone
    s.world.map(p2, 0x70_0000, PROG, pages=1)  # the header alone: not the probed offset
    s.world.map(p3, 0x60_0000, PROG, flags=VM_MAYEXEC | VM_WRITE)  # writable: valid_vma() refuses it
    s.world.map(p3, 0x68_0000, PROG, flags=VM_MAYEXEC | VM_MAYSHARE)  # shared: refused too
    s.world.map(p3, 0x58_0000, LIB)  # another file
    assert s.um.hook is None and s.rig.km.addresses() == []
    up = Uprobe(PROG, FUNC)
    s.um.register_uprobe(up)
    assert s.bps() == [BASE + FUNC, 0x50_0000]
    # The hook on new mappings came with the first uprobe: an int3 on vma_set_page_prot.
    assert s.um.hook is not None and s.um.hook.registered and s.rig.km.addresses() == [s.hook]
    assert s.rig.at(s.hook) == BRK
    second = Uprobe(PROG, LOAD)
    same = Uprobe(PROG, FUNC)
    s.um.register_uprobe(second)
    s.um.register_uprobe(same)
    assert s.bps() == [BASE + FUNC, BASE + LOAD, 0x50_0000, 0x50_0004]
    assert s.rig.km.addresses() == [s.hook]  # one hook for every uprobe
    s.um.unregister_uprobe(up)
    assert s.bps() == [BASE + FUNC, BASE + LOAD, 0x50_0000, 0x50_0004]  # `same` is still there
    s.um.unregister_uprobe(same)
    assert s.bps() == [BASE + LOAD, 0x50_0004] and s.rig.km.addresses() == [s.hook]
    s.um.unregister_uprobe(second)
    assert s.bps() == [] and s.rig.km.addresses() == [] and s.um.hook is None and s.rig.text_unchanged()
    assert s.um.probes == {} and s.um.spaces == {} and s.um.points == {}
    with pytest.raises(InvalidProbe, match="not registered"):
        s.um.unregister_uprobe(up)


def test_registration_refuses_what_the_kernel_refuses(s: Setup) -> None:
    with pytest.raises(InvalidProbe, match="ENOENT"):
        s.um.register_uprobe(Uprobe("/usr/bin/missing", FUNC))
    with pytest.raises(InvalidProbe, match="past the end"):
        s.um.register_uprobe(Uprobe(PROG, 2 * PAGE + 1))
    with pytest.raises(InvalidProbe, match="ENOTSUPP"):
        s.um.register_uprobe(Uprobe(PROG, TRAP))
    assert s.um.hook is None and s.rig.km.addresses() == [] and s.um.probes == {}


def test_an_offset_not_aligned_to_an_instruction_is_refused(s: Setup) -> None:
    """uprobe_register()'s IS_ALIGNED(offset, UPROBE_SWBP_INSN_SIZE): the toy's instructions are words."""
    with pytest.raises(InvalidProbe, match="not aligned to 4 bytes"):
        s.um.register_uprobe(Uprobe(PROG, FUNC + 2))
    assert s.um.hook is None and s.um.probes == {}


def test_a_new_mapping_is_armed_by_the_hook_before_the_task_runs(s: Setup) -> None:
    up = Uprobe(PROG, FUNC)
    s.um.register_uprobe(up)
    assert s.bps() == []  # nobody maps the file yet
    p = s.world.process()
    # mmap_region() links each vma and calls vma_set_page_prot() on it before the process runs again.
    for vma in (s.world.map(p, 0x10_0000, None), s.world.map(p, 0x20_0000, LIB),
                s.world.map(p, 0x30_0000, PROG, flags=VM_MAYEXEC | VM_WRITE)):  # fmt: skip
        s.mmap_hook(vma)
        assert s.bps() == []
    s.mmap_hook(s.world.map(p, BASE, PROG))
    assert s.bps() == [BASE + FUNC] and s.um._pending == {}
    after = s.stop(p, BASE + FUNC, r0=40)
    assert up.nhit == 1 and after["r0"] == 41 and after["pc"] == BASE + FUNC + 4
    s.mmap_hook(s.world.map(p, BASE, PROG))  # the same mapping again (mprotect): one breakpoint still
    assert s.bps() == [BASE + FUNC]


def test_a_probed_file_freed_and_its_inode_memory_reused_retires_its_probes(s: Setup) -> None:
    """The kernel's uprobe holds the inode; qprobe cannot: a new file in the freed inode's memory is not it."""
    up = Uprobe(PROG, FUNC)
    s.um.register_uprobe(up)
    p = s.world.process()
    s.mmap_hook(s.world.map(p, BASE, PROG))
    assert s.bps() == [BASE + FUNC]
    s.world.reuse(PROG, "/tmp/new")  # same address_space address, same page-cache frames
    q = s.world.process()
    s.mmap_hook(s.world.map(q, 0x40_0000, "/tmp/new"))
    assert s.bps() == [] and s.um.spaces == {} and up.registered
    again = Uprobe("/tmp/new", FUNC)  # a probe on the new file is the new file's alone
    s.um.register_uprobe(again)
    assert s.bps() == [0x40_0000 + FUNC]
    s.stop(q, 0x40_0000 + FUNC, r0=1)
    assert again.nhit == 1 and up.nhit == 0
    s.um.unregister_uprobe(again)
    s.um.unregister_uprobe(up)
    assert s.bps() == [] and s.um.hook is None and s.rig.km.addresses() == [] and s.um.registered() == []
    # Retired alone: its unregistration takes the hook out too (a later registration arms a new one).
    gone = Uprobe("/tmp/new", FUNC)
    s.um.register_uprobe(gone)
    s.world.reuse("/tmp/new", "/tmp/newer")
    s.mmap_hook(s.world.map(q, 0x80_0000, "/tmp/newer"))
    assert s.um.retired == [gone] and s.um.hook is not None
    s.um.unregister_uprobe(gone)
    assert s.um.hook is None and s.rig.km.addresses() == [] and s.bps() == []


# -- whose: the stopped process's page decides ------------------------------------------------------


def test_a_stop_in_a_process_that_maps_something_else_there_is_stepped_but_no_hit(s: Setup) -> None:
    probed, other, anon = s.world.process(), s.world.process(), s.world.process()
    s.world.map(probed, BASE, PROG)
    s.world.map(other, BASE, LIB)  # ADDI 2 at the probed address
    s.world.map(anon, BASE, None)  # ADDI 9 there
    seen: list[int] = []
    up = Uprobe(PROG, FUNC, handler=lambda u, regs: seen.append(regs.r0))
    s.um.register_uprobe(up)
    assert s.bps() == [BASE + FUNC]
    assert s.stop(other, BASE + FUNC, r0=100)["r0"] == 102  # its own instruction ran, in place
    assert s.stop(anon, BASE + FUNC, r0=100)["r0"] == 109
    assert up.nhit == 0 and seen == []
    assert s.stop(probed, BASE + FUNC, r0=100)["r0"] == 101
    assert up.nhit == 1 and seen == [100]
    assert s.rig.t.cpu.steps == [(A, BASE + FUNC)] * 3


def test_a_stop_on_a_page_that_is_not_present_is_no_hit(s: Setup) -> None:
    p = s.world.process()
    s.world.map(p, BASE, PROG, present=False)
    up = Uprobe(PROG, FUNC)
    s.um.register_uprobe(up)
    # QEMU stops on the breakpoint before the fetch; the fetch faults into the kernel.
    after = s.stop(p, BASE + FUNC, r0=1)
    assert up.nhit == 0 and after["pc"] == ENTRY and after["r0"] == 1 and s.um.restarts == set()
    s.world.fault_in(p, BASE + FUNC)  # the kernel maps the page and returns to the instruction
    after = s.stop(p, BASE + FUNC, r0=1)
    assert up.nhit == 1 and after["r0"] == 2 and after["pc"] == BASE + FUNC + 4


def test_an_instruction_the_architecture_performs_is_one_stop_and_no_step(s: Setup) -> None:
    p = s.world.process()
    s.world.map(p, BASE, PROG)
    seen: list[int] = []
    up = Uprobe(PROG, FUNC + 8, handler=lambda u, regs: seen.append(regs.ip))  # a NOP, which the toy performs
    s.um.register_uprobe(up)
    after = s.stop(p, BASE + FUNC + 8, r0=5)
    assert up.nhit == 1 and seen == [BASE + FUNC + 8]
    assert after["pc"] == BASE + FUNC + 12 and after["r0"] == 5 and s.rig.t.cpu.steps == []
    assert (s.um.emulated, s.um.stepped) == (1, 0)
    s.um.register_uprobe(Uprobe(PROG, FUNC))  # an ADDI, which it steps
    assert s.stop(p, BASE + FUNC, r0=5)["r0"] == 6 and s.rig.t.cpu.steps == [(A, BASE + FUNC)]
    assert (s.um.emulated, s.um.stepped) == (1, 1)


def test_a_handler_s_registers_and_the_performed_instruction_are_one_write(s: Setup) -> None:
    """A qprobe killed between two writes would leave the vCPU with the handler's change and not the ip past
    the instruction, or the reverse: the gdbstub applies one write whole."""
    p = s.world.process()
    s.world.map(p, BASE, PROG)

    def change(u: Uprobe, regs: PtRegs) -> None:
        regs.r0 = 77

    s.um.register_uprobe(Uprobe(PROG, FUNC + 8, handler=change))  # a NOP, which the toy performs
    s.rig.t.cpu.written.clear()
    after = s.stop(p, BASE + FUNC + 8, r0=5)
    assert after["r0"] == 77 and after["pc"] == BASE + FUNC + 12
    assert [w for _tid, w in s.rig.t.cpu.written] == [{"r0": 77, "pc": BASE + FUNC + 12}]


def test_a_probed_instruction_whose_step_faults_runs_again_without_a_second_hit(s: Setup) -> None:
    p = s.world.process()
    s.world.map(p, BASE, PROG)
    up = Uprobe(PROG, LOAD)
    s.um.register_uprobe(up)
    sp = 0x1000_0000  # LDR reads [sp]: not present yet
    after = s.stop(p, BASE + LOAD, sp=sp)
    assert up.nhit == 1 and after["pc"] == ENTRY and s.um.restarts == {(p.root, BASE + LOAD, sp)}
    s.rig.t.mem.map_user(p.root, sp, s.world.frame((0x1234).to_bytes(8, "little")))  # the kernel's fault handling
    after = s.stop(p, BASE + LOAD, sp=sp)  # the same instruction again, from the fault's return
    assert up.nhit == 1 and after["r1"] == 0x1234 and after["pc"] == BASE + LOAD + 4 and s.um.restarts == set()
    s.stop(p, BASE + LOAD, sp=sp)  # the next run of it is a hit again
    assert up.nhit == 2
    assert s.rig.t.cpu.steps == [(A, BASE + LOAD)] * 3


def test_a_private_copy_of_the_page_is_decided_by_the_vma(s: Setup) -> None:
    probed, other, anon = s.world.process(), s.world.process(), s.world.process()
    s.world.map(probed, BASE, PROG, private=True)  # a debugger wrote into its text: copy-on-write
    s.world.map(other, BASE, LIB, private=True)
    s.world.map(anon, BASE, None)
    up = Uprobe(PROG, FUNC)
    s.um.register_uprobe(up)
    assert s.stop(other, BASE + FUNC, r0=0)["r0"] == 2
    assert s.stop(anon, BASE + FUNC, r0=0)["r0"] == 9
    assert up.nhit == 0
    assert s.stop(probed, BASE + FUNC, r0=0)["r0"] == 1
    assert up.nhit == 1


# -- handlers -------------------------------------------------------------------------------------


def test_a_filter_that_refuses_counts_the_hit_as_filtered_only(s: Setup) -> None:
    p = s.world.process()
    s.world.map(p, BASE, PROG)
    ran: list[int] = []
    up = Uprobe(PROG, FUNC, handler=lambda u, regs: ran.append(regs.ip), filter=lambda u, regs: regs.r0 > 10)
    s.um.register_uprobe(up)
    assert s.stop(p, BASE + FUNC, r0=3)["r0"] == 4
    assert up.nfiltered == 1 and up.nhit == 0 and ran == []
    s.stop(p, BASE + FUNC, r0=30)
    assert up.nfiltered == 1 and up.nhit == 1 and ran == [BASE + FUNC]
    assert s.rig.t.cpu.steps == [(A, BASE + FUNC)] * 2


def test_a_handler_that_raises_is_counted_and_the_instruction_still_runs(s: Setup) -> None:
    p = s.world.process()
    s.world.map(p, BASE, PROG)

    def boom(u: Uprobe, regs: PtRegs) -> None:
        raise ValueError("boom")

    up = Uprobe(PROG, FUNC, handler=boom)
    s.um.register_uprobe(up)
    after = s.stop(p, BASE + FUNC, r0=5)
    assert up.nhit == 1 and up.nfaults == 1 and up.errors == [f"handler of {PROG}:{FUNC:#x} raised ValueError: boom"]
    assert after["r0"] == 6 and after["pc"] == BASE + FUNC + 4


def test_a_handler_that_moves_ip_skips_the_instruction(s: Setup) -> None:
    p = s.world.process()
    s.world.map(p, BASE, PROG)

    def skip(u: Uprobe, regs: PtRegs) -> None:
        regs.ip += 8
        regs.r0 = 77

    s.um.register_uprobe(Uprobe(PROG, FUNC, handler=skip))
    after = s.stop(p, BASE + FUNC, r0=5)
    assert after["pc"] == BASE + FUNC + 8 and after["r0"] == 77 and s.rig.t.cpu.steps == []  # the ADDI never ran


# -- returns -------------------------------------------------------------------------------------------


def _returns(s: Setup) -> tuple[Uprobe, list[tuple[int, int, int, int]]]:
    """A return probe on FUNC; what its ret_handler saw: (func, ip, sp, r0)."""
    seen: list[tuple[int, int, int, int]] = []
    up = Uretprobe(PROG, FUNC, ret_handler=lambda u, func, regs: seen.append((func, regs.ip, regs.sp, regs.r0)))
    s.um.register_uprobe(up)
    return up, seen


def test_a_return_is_the_same_tasks_stop_at_the_return_address_with_its_stack(s: Setup) -> None:
    p = s.world.process()
    s.world.map(p, BASE, PROG)
    up, seen = _returns(s)
    sp = _push(s, p, STACK_TOP - 0x40, BASE + CALLER)
    s.stop(p, BASE + FUNC, sp=sp)
    assert up.nhit == 1 and up.nreturns == 0 and s.bps() == [BASE + FUNC, BASE + CALLER]
    s.stop(p, BASE + CALLER, sp=sp + 4, r0=7)
    assert up.nreturns == 1 and seen == [(BASE + FUNC, BASE + CALLER, sp + 4, 7)]
    assert s.bps() == [BASE + FUNC] and s.um.returns.by_task == {}


def test_recursive_calls_return_in_order_each_with_its_own_stack(s: Setup) -> None:
    p = s.world.process()
    s.world.map(p, BASE, PROG)
    up, seen = _returns(s)
    outer = _push(s, p, STACK_TOP - 0x40, BASE + CALLER)
    middle = _push(s, p, outer - 0x10, BASE + SITE)  # FUNC calls itself from SITE
    inner = _push(s, p, middle - 0x10, BASE + SITE)
    for sp in (outer, middle, inner):
        s.stop(p, BASE + FUNC, sp=sp)
    assert up.nhit == 3 and s.bps() == [BASE + FUNC, BASE + SITE, BASE + CALLER]
    s.stop(p, BASE + SITE, sp=inner + 4, r0=1)
    s.stop(p, BASE + SITE, sp=middle + 4, r0=2)
    assert s.bps() == [BASE + FUNC, BASE + CALLER]
    s.stop(p, BASE + CALLER, sp=outer + 4, r0=3)
    func = BASE + FUNC
    assert seen == [(func, BASE + SITE, inner + 4, 1), (func, BASE + SITE, middle + 4, 2),
                    (func, BASE + CALLER, outer + 4, 3)]  # fmt: skip
    assert up.nreturns == 3 and s.bps() == [BASE + FUNC] and s.um.returns.by_task == {}


def test_frames_left_by_longjmp_are_dropped_at_the_return_of_an_outer_one(s: Setup) -> None:
    p = s.world.process()
    s.world.map(p, BASE, PROG)
    up, seen = _returns(s)
    outer = _push(s, p, STACK_TOP - 0x40, BASE + CALLER)
    middle = _push(s, p, outer - 0x10, BASE + SITE)
    inner = _push(s, p, middle - 0x10, BASE + SITE)
    for sp in (outer, middle, inner):
        s.stop(p, BASE + FUNC, sp=sp)
    assert s.bps() == [BASE + FUNC, BASE + SITE, BASE + CALLER]
    # The inner call longjmp()ed into the middle one, which returns: to the address the inner one would
    # have returned to, but with its own stack.  That is one return, the middle call's.
    s.stop(p, BASE + SITE, sp=middle + 4, r0=1)
    assert seen == [(BASE + FUNC, BASE + SITE, middle + 4, 1)] and up.nreturns == 1
    assert s.bps() == [BASE + FUNC, BASE + CALLER] and len(s.um.returns.by_task[(p.root, p.task)]) == 1
    # The outer call calls FUNC again from AGAIN, which longjmp()s out of both: the next return the task
    # makes is the outer one's.
    s.stop(p, BASE + FUNC, sp=_push(s, p, middle, BASE + AGAIN))
    assert s.bps() == [BASE + FUNC, BASE + AGAIN, BASE + CALLER]
    s.stop(p, BASE + CALLER, sp=outer + 4, r0=2)
    assert seen[1:] == [(BASE + FUNC, BASE + CALLER, outer + 4, 2)] and up.nreturns == 2
    assert s.bps() == [BASE + FUNC] and s.um.returns.by_task == {}


def test_a_call_drops_the_calls_longjmp_left_below_it(s: Setup) -> None:
    p = s.world.process()
    s.world.map(p, BASE, PROG)
    up, seen = _returns(s)
    outer = _push(s, p, STACK_TOP - 0x800, BASE + CALLER)
    for sp in [outer] + [_push(s, p, outer - 8 * (n + 1), BASE + SITE) for n in range(39)]:
        s.stop(p, BASE + FUNC, sp=sp)
    assert len(s.um.returns.by_task[(p.root, p.task)]) == 40
    # The deepest call longjmp()ed back into the outermost one, which calls FUNC again from AGAIN: the
    # kernel's prepare_uretprobe() drops the instances of the frames below the new call's
    # (cleanup_return_instances), so the task has room for MAX_URETPROBE_DEPTH - 2 more.
    again = _push(s, p, outer - 4, BASE + AGAIN)
    s.stop(p, BASE + FUNC, sp=again)
    assert len(s.um.returns.by_task[(p.root, p.task)]) == 2
    assert s.bps() == [BASE + FUNC, BASE + AGAIN, BASE + CALLER]  # SITE's breakpoint went with its calls
    for n in range(MAX_URETPROBE_DEPTH - 2):
        s.stop(p, BASE + FUNC, sp=_push(s, p, again - 8 * (n + 1), BASE + SITE))
    assert up.nmissed == 0 and len(s.um.returns.by_task[(p.root, p.task)]) == MAX_URETPROBE_DEPTH
    s.stop(p, BASE + AGAIN, sp=again + 4, r0=1)  # those longjmp()ed out too
    s.stop(p, BASE + CALLER, sp=outer + 4, r0=2)
    assert seen == [(BASE + FUNC, BASE + AGAIN, again + 4, 1), (BASE + FUNC, BASE + CALLER, outer + 4, 2)]
    assert up.nreturns == 2 and s.bps() == [BASE + FUNC] and s.um.returns.by_task == {}


def test_a_tail_call_keeps_the_callers_instance_and_both_return(s: Setup) -> None:
    p = s.world.process()
    s.world.map(p, BASE, PROG)
    _up, seen = _returns(s)
    tail: list[tuple[int, int]] = []
    s.um.register_uprobe(Uretprobe(PROG, LOAD, ret_handler=lambda u, func, regs: tail.append((func, regs.sp))))
    sp = _push(s, p, STACK_TOP - 0x40, BASE + CALLER)
    s.stop(p, BASE + FUNC, sp=sp)
    s.stop(p, BASE + LOAD, sp=sp)  # FUNC jumped to LOAD: the same frame, the same return address
    assert len(s.um.returns.by_task[(p.root, p.task)]) == 2
    s.stop(p, BASE + CALLER, sp=sp + 4, r0=0)
    assert tail == [(BASE + LOAD, sp + 4)] and seen == [(BASE + FUNC, BASE + CALLER, sp + 4, 0)]
    assert s.bps() == [BASE + FUNC, BASE + LOAD] and s.um.returns.by_task == {}


def test_calls_deeper_than_max_uretprobe_depth_are_missed(s: Setup) -> None:
    p = s.world.process()
    s.world.map(p, BASE, PROG)
    up, seen = _returns(s)
    sps = [_push(s, p, STACK_TOP - 0x10 - 8 * n, BASE + SITE) for n in range(MAX_URETPROBE_DEPTH + 1)]
    for sp in sps:
        s.stop(p, BASE + FUNC, sp=sp)
    assert up.nhit == MAX_URETPROBE_DEPTH + 1 and up.nmissed == 1
    assert len(s.um.returns.by_task[(p.root, p.task)]) == MAX_URETPROBE_DEPTH
    assert s.um.points[BASE + SITE].returns == MAX_URETPROBE_DEPTH
    for sp in reversed(sps):  # the deepest call returns first; its instance was never taken
        s.stop(p, BASE + SITE, sp=sp + 4)
    assert up.nreturns == MAX_URETPROBE_DEPTH and [sp for _f, _ip, sp, _r0 in seen] == [sp + 4 for sp in sps[-2::-1]]
    assert s.bps() == [BASE + FUNC]


def test_a_stop_of_another_task_at_the_return_address_is_not_this_tasks_return(s: Setup) -> None:
    p = s.world.process()
    q = s.world.thread(p, p.task + 0x800)  # another thread of the same process: same page tables
    s.world.map(p, BASE, PROG)
    up, seen = _returns(s)
    sp = _push(s, p, STACK_TOP - 0x40, BASE + CALLER)
    s.stop(p, BASE + FUNC, sp=sp)
    after = s.stop(q, BASE + CALLER, sp=sp + 4, tid=B)
    assert up.nreturns == 0 and seen == [] and after["pc"] == BASE + CALLER + 4
    assert s.bps() == [BASE + FUNC, BASE + CALLER]
    s.stop(p, BASE + CALLER, sp=sp + 4)
    assert up.nreturns == 1 and s.bps() == [BASE + FUNC]


def test_collect_drops_addresses_no_mapping_holds(s: Setup) -> None:
    p1, p2 = s.world.process(), s.world.process()
    s.world.map(p1, BASE, PROG)
    gone = s.world.map(p2, 0x50_0000, PROG)
    up = Uprobe(PROG, FUNC)
    s.um.register_uprobe(up)
    assert s.bps() == [BASE + FUNC, 0x50_0000 + FUNC]
    s.world.unmap(gone)  # p2 exited
    s.um._collect()
    assert s.bps() == [BASE + FUNC] and s.um.points[BASE + FUNC].keys == {(s.world.files[PROG].mapping, FUNC)}
    s.stop(p1, BASE + FUNC)
    assert up.nhit == 1


def test_addresses_are_collected_as_new_mappings_add_them(s: Setup) -> None:
    s.world.map(s.world.process(), BASE, PROG)  # a process that stays
    s.um.register_uprobe(Uprobe(PROG, FUNC))
    at = [0x100_0000 + n * 0x10_0000 for n in range(20)]
    for start in at:  # short-lived processes, each at its own address (ASLR)
        vma = s.world.map(s.world.process(), start, PROG)
        s.mmap_hook(vma)
        assert BASE + FUNC in s.bps() and start + FUNC in s.bps()
        s.world.unmap(vma)  # it exited
    # At 17 addresses (more than 2 * 0 + 16: nothing collected yet) a collection kept the two live ones;
    # the next one waits for more than 2 * 2 + 16.
    assert s.bps() == [BASE + FUNC] + [start + FUNC for start in at[15:]]


# -- an indirect function's implementation, as the loader of each process mapping the file picked it -------


def test_impl_is_read_from_the_got_slot_of_each_process_mapping_the_file(s: Setup, tmp_path: Path) -> None:
    path, data = "/usr/lib/libifunc.so", ifunc_library(tmp_path).read_bytes()
    s.world.file(path, data)
    elf = UserElf(data, path)
    (slot,) = elf.irelative_slots(elf.functions("chosen")[0].vaddr)
    impl, other = elf.functions("plus_two")[0], elf.functions("plain")[0]
    with pytest.raises(InvalidProbe, match="no process of the guest maps"):
        s.um.resolve(path, "chosen@impl")

    def load(p: Proc, base: int, picked: int) -> None:
        """``path`` loaded at ``base``: its first page, and the page of the slot, where the loader wrote."""
        page = slot // PAGE * PAGE
        s.world.map(p, base, path, pages=1)
        s.world.map(p, base + page, path, file_start=page, pages=1, private=True, flags=0)
        s.rig.t.mem.write_phys(s.rig.t.mem.virt_to_phys(base + slot, p.root), (base + picked).to_bytes(8, "little"))

    load(s.world.process(), 0x50_0000, impl.vaddr)
    load(s.world.process(), 0x90_0000, impl.vaddr)  # another load base, the same pick
    assert s.um.resolve(path, "chosen@impl") == impl.offset != s.um.resolve(path, "chosen")
    load(s.world.process(), 0xB0_0000, other.vaddr)  # a process whose loader picked otherwise
    with pytest.raises(InvalidProbe, match="picked different implementations") as info:
        s.um.resolve(path, "chosen@impl")
    assert f"0x{impl.offset:x}" in str(info.value) and f"0x{other.offset:x}" in str(info.value)
