"""User-space probes as the kernel's uprobes (kernel/events/uprobes.c), from the host: nothing written into the guest.

(A probe that runs nothing on the host at its hits is counted in the guest instead, by the guest kernel's own
uprobes, where it can be: qprobe.core.uguest.  What follows is the path of every other probe, and of those
given ``in_guest=False``.)

A uprobe is keyed as the kernel keys it, by (file, offset): the file's ``address_space`` and a byte offset
in it.  The kernel writes its breakpoint instruction (x86's int3, arm64's brk) into a private copy of the
page in every mm that maps the file and runs the displaced instruction out of line in a per-mm page; qprobe
needs neither.  It puts one of the gdbstub's own breakpoints (nothing written under TCG) at every virtual
address where some process maps the offset, and decides at each stop whether the process that stopped
really runs that file there:

* **where:** registration finds every current mapping in the file's ``i_mmap`` tree (the kernel's
  ``register_for_each_vma``); a probe where ``mmap_region`` finishes a mapping tells of each new one before
  the process can run it (the kernel's ``uprobe_mmap`` is called there); a fork's child has its parent's
  addresses, so nothing is needed for it (``uprobe_dup_mmap``).  Addresses no mapping uses any more are
  collected as they grow.
* **whose:** a breakpoint stops every process that runs that address, whatever it maps there.  The page
  the stopped process runs is looked up: a page-cache page of the probed file at the right index is a hit
  (two reads of its ``struct page``); a private copy (text a debugger or the program wrote: copy-on-write)
  is decided by the process's vma, as the kernel's probe stays in that mm; any other page is not a hit.
  The kernel's probe pins its inode; qprobe's does not, so a file freed after its deletion, whose inode's
  memory now holds another file (another inode number or generation), is no hit and no mapping to arm.
* **once:** QEMU checks its breakpoints before fetching the instruction, so a process whose text page is
  not present yet stops there, faults on the fetch and stops again: a stop on a page that is not present
  is no hit.  An instruction stepped in place that faults (``arch_uprobe_xol_was_trapped``) runs again
  after the kernel handles the fault; that second stop is no hit either.
* **returns:** a return probe's entry stops at the return address too (qprobe.core.ureturns).
* **one stop:** the instruction at the stop (the probed one, or the one a call returns to) is performed on
  the host where the architecture can (``arch_uprobe_emulate``: the kernel's own user emulations, and the
  moves and arithmetic of prologues and call sites), on the task's memory as its own accesses would find
  it (qprobe.core.taskmem.UserMemory: a store only to a writable, dirty page).  Anything else is
  single-stepped in place: a second VM stop.

The page cache, ``read()`` of the file, ``/proc/PID/mem`` and the disk all keep the original bytes: there
is no breakpoint instruction anywhere in the guest.  A hit is one VM stop where the host performs the
instruction, two where it steps it, in any process that runs the address; each stop costs QEMU 7.2 a flush
of its translated code.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping as Regs
from typing import Protocol

from qprobe.arch import Arch
from qprobe.core.handlers import Handlers
from qprobe.core.kprobe import Kprobe
from qprobe.core.regs import PtRegs, RegsSource
from qprobe.core.taskmem import UserMemory
from qprobe.core.uguest import GuestUprobes
from qprobe.core.upoints import UprobePoints
from qprobe.core.uprobe import Uprobe
from qprobe.core.ureturns import ReturnInstance, UprobeReturns
from qprobe.errors import InvalidProbe, MemoryFault
from qprobe.kernel.program import KernelData
from qprobe.kernel.ufile import GuestFile, Mapping, UserFiles
from qprobe.kernel.userelf import UserElf, UserElfError
from qprobe.vmm.machine import Machine

__all__ = ["Kprobes", "UprobeManager"]

MAX_RESTARTS = 1024
MAX_ELF = 256 << 20  # a file read whole for its symbols (libc is 2 MB)
# The hook on new mappings: mmap_region() ends with vma_set_page_prot(vma) on the vma it made or grew,
# after linking it into the file's i_mmap, beside uprobe_mmap(vma) (mm/mmap.c, Linux 4.x to 6.12: 6.12's
# __mmap_region too); mprotect_fixup() calls it for a vma whose protection changed.
MMAP_HOOK = "vma_set_page_prot"


def counted_by(guest: GuestUprobes | None, up: Uprobe) -> GuestUprobes | None:
    """Where ``up`` is counted in the guest (None: it stops the VM at its hits)."""
    if up.in_guest is False or not up.runs_nothing:
        return None
    why = "qprobe counts no uprobe in this guest" if guest is None else guest.unavailable
    if why is None:
        return guest
    if up.in_guest:
        raise InvalidProbe(f"{up.where()} cannot be counted in the guest: {why}")
    return None


class Stepper(Protocol):
    """The trap path (qprobe.core.dispatch.Dispatcher): its single-step (the registers after it), and its hook."""

    def step(self, tid: str, ip: int) -> dict[str, int]: ...
    def install(self, watch_only: bool = False) -> None: ...


class Kprobes(Protocol):
    """What the uprobes use of the kprobes (qprobe.core.kprobes.KprobeManager): a kprobe of their own on new
    mappings (MMAP_HOOK)."""

    def register_kprobe(self, kp: Kprobe, optimize: bool = True) -> None: ...
    def unregister_kprobe(self, kp: Kprobe) -> None: ...


class UprobeManager:
    """The uprobes of one target; every method that changes state runs on the stop loop."""

    def __init__(self, machine: Machine, arch: Arch, kernel: KernelData, kprobes: Kprobes, handlers: Handlers,
                 regs: RegsSource, stepper: Stepper, guest: GuestUprobes | None = None) -> None:  # fmt: skip
        """``handlers``: the one place handlers run, the kprobes' too; ``regs``: pt_regs for them;
        ``stepper``: the trap path's single-step; ``guest``: the probes counted in the guest, where it can."""
        self.machine = machine
        self.guest = guest
        self.arch = arch
        self.kernel = kernel
        self.kprobes = kprobes
        self.handlers = handlers
        self.regs = regs
        self.stepper = stepper
        self._elves: dict[tuple[int, int], UserElf] = {}  # (inode, size) -> its ELF, read once
        self._files: UserFiles | None = None
        self.probes: dict[tuple[int, int], list[Uprobe]] = {}  # (address_space, offset) -> consumers
        self.spaces: dict[int, GuestFile] = {}  # address_space -> the file, while some probe is on it
        self.points = UprobePoints(machine, self._hit)
        self.returns = UprobeReturns(arch, handlers, self.points)
        self.restarts: set[tuple[int, int, int]] = set()  # (root, ip, sp) of a probed instruction that faulted
        self.hook: Kprobe | None = None
        self.retired: list[Uprobe] = []  # registered on a file since freed: they match nothing
        self._pending: dict[str, int] = {}  # vCPU -> the vma its vma_set_page_prot() call is given
        self._after_collect = 0
        self.emulated = 0  # stops whose instruction the host performed
        self.stepped = 0  # stops whose instruction was single-stepped in place

    @property
    def files(self) -> UserFiles:
        if self._files is None:
            self._files = UserFiles(self.kernel.prog)
        return self._files

    # -- registration -------------------------------------------------------------------------
    def register_uprobe(self, up: Uprobe) -> None:
        if up.registered:
            raise InvalidProbe(f"{up.where()} is already registered (EINVAL)")
        guest = counted_by(self.guest, up)
        if guest is None:
            self.machine.call(lambda: self._register(up))
            up.in_guest = False
            return
        f, offset = self.machine.call(lambda: self._checked(up))
        guest.register(up, f, offset)  # guest calls: from this thread, while the stop loop runs the VM
        up.offset, up.file, up.registered, up.in_guest = offset, f, True, True
        # Under QEMU's multi-threaded TCG a guest that toggles its own trace events can loop on a stale int3
        # of its text_poke_bp; the trap hook ends that loop and, as a watchpoint, costs these probes nothing.
        self.machine.call(lambda: self.stepper.install(watch_only=True))

    def unregister_uprobe(self, up: Uprobe) -> None:
        if not up.registered:
            raise InvalidProbe(f"{up.where()} is not registered (EINVAL)")
        if self.guest is not None and up in self.guest.registered:
            self.guest.unregister(up)
            up.registered = False
            return
        self.machine.call(lambda: self._unregister(up))

    def registered(self) -> list[Uprobe]:
        guest = list(self.guest.registered) if self.guest is not None else []
        return [*(up for consumers in self.probes.values() for up in consumers), *self.retired, *guest]

    def remove_all(self) -> None:
        for up in self.registered():
            self.unregister_uprobe(up)

    def _register(self, up: Uprobe) -> None:
        f, offset = self._checked(up)
        self._ensure_hook()
        known = self.spaces.get(f.mapping)
        if known is not None and known != f:
            self._retire(f.mapping)  # a file freed since its probes were registered; this one took its memory
        key = (f.mapping, offset)
        up.offset, up.file = offset, f
        self.probes.setdefault(key, []).append(up)
        self.spaces[f.mapping] = f
        up.registered = True
        for m in self.files.mappings(f):
            va = m.address_of(offset)
            if va is not None and m.probeable:
                self.points.add(va, key)

    def _checked(self, up: Uprobe) -> tuple[GuestFile, int]:
        """The file and offset ``up`` names, refused as the kernel's uprobe_register() refuses them."""
        f = self.files.lookup(up.path)
        if f is None:
            raise InvalidProbe(f"{up.path}: no regular file there in the guest's dentry cache (ENOENT)")
        offset = up.offset if up.offset is not None else self._symbol_offset(f, str(up.symbol))
        # uprobe_register(): an offset past the end of the file is EINVAL.
        if offset > f.size:
            raise InvalidProbe(f"{up.path}:{offset:#x} is past the end of the file ({f.size} bytes) (EINVAL)")
        if self.arch.uprobes is None:
            raise InvalidProbe(f"{up.path}:{offset:#x}: no user-space probes on this architecture (ENOTSUPP)")
        # uprobe_register()'s alignment check: a breakpoint inside an instruction would never stop (an arm64
        # pc is always a multiple of 4).
        align = self.arch.uprobes.uprobe_swbp_insn_size
        if offset % align:
            raise InvalidProbe(f"{up.path}:{offset:#x} is not aligned to {align} bytes (EINVAL)")
        code = self.files.read(f, offset, 16)
        why = self.arch.uprobes.arch_uprobe_analyze_insn(code) if code else None
        if why is not None:
            raise InvalidProbe(f"{up.path}:{offset:#x}: {why}")
        return f, offset

    def _symbol_offset(self, f: GuestFile, symbol: str) -> int:
        try:
            elf = self._elf(f)
            return elf.resolve(symbol, lambda slot: self._loaded(f, elf, slot))
        except UserElfError as exc:
            raise InvalidProbe(str(exc)) from None

    def resolve(self, path: str, spec: str) -> int:
        """The file offset of ``SYMBOL[+OFFS]`` (or ``SYMBOL@impl[+OFFS]``) in the guest's file ``path``."""

        def find() -> int:
            f = self.files.lookup(path)
            if f is None:
                raise InvalidProbe(f"{path}: no regular file there in the guest's dentry cache (ENOENT)")
            return self._symbol_offset(f, spec)

        return self.machine.call(find)

    def _loaded(self, f: GuestFile, elf: UserElf, slot: int) -> list[int]:
        """What the GOT slot at ``slot`` (a vaddr of ``f``'s ELF) holds in each process that maps ``f``, less
        the process's load bias: each mapping of the file's start tells where the ELF's layout begins."""
        first = elf.vaddr_of(0)
        out: list[int] = []
        for m in self.files.mappings(f):
            if m.file_start != 0 or first is None:
                continue
            bias = m.start - first
            raw = self.files.read_user(m.mm, bias + slot, 8)
            if raw is not None:
                out.append(int.from_bytes(raw, "little") - bias)
        return out

    def elf(self, path: str) -> UserElf:
        """The ELF of the guest's file at ``path``, as its page cache holds it (InvalidProbe if it cannot be read)."""

        def read() -> UserElf:
            f = self.files.lookup(path)
            if f is None:
                raise InvalidProbe(f"{path}: no regular file there in the guest's dentry cache (ENOENT)")
            try:
                return self._elf(f)
            except UserElfError as exc:
                raise InvalidProbe(str(exc)) from None

        return self.machine.call(read)

    def _elf(self, f: GuestFile) -> UserElf:
        elf = self._elves.get((f.inode, f.size))
        if elf is None:
            if f.size > MAX_ELF:
                raise UserElfError(f"{f.path} is {f.size} bytes: qprobe reads ELF files up to {MAX_ELF}")
            data = self.files.read(f, 0, f.size)
            if data is None:
                raise UserElfError(f"{f.path}: not all of it is in the guest's page cache (read it once: cat it)")
            elf = self._elves[(f.inode, f.size)] = UserElf(data, f.path)
        return elf

    def _unregister(self, up: Uprobe) -> None:
        assert up.file is not None and up.offset is not None
        if up in self.retired:
            self.retired.remove(up)
            up.registered = False
            if not self.probes:
                self._drop_hook()
            return
        key = (up.file.mapping, up.offset)
        consumers = self.probes[key]
        consumers.remove(up)
        up.registered = False
        self.returns.drop_probe(up)
        if consumers:
            return
        del self.probes[key]
        if not any(space == up.file.mapping for space, _ in self.probes):
            self.spaces.pop(up.file.mapping, None)
        for va, point in list(self.points.items()):
            point.keys.discard(key)
            self.points.prune(va, point)
        if not self.probes:
            self._drop_hook()

    def _ensure_hook(self) -> None:
        if self.hook is not None and self.hook.registered:
            return
        if MMAP_HOOK not in self.kernel.symbols:
            raise InvalidProbe(f"uprobes follow new mappings at {MMAP_HOOK}(), which this kernel does not have")
        # A post_handler keeps the probe on its breakpoint (a probe with one is never jump-optimized), so both
        # handlers run on the stop loop with every vCPU stopped: the breakpoints are in before the task runs on.
        hook = Kprobe(symbol_name=MMAP_HOOK, pre_handler=self._vma_entry, post_handler=self._vma_ready)
        self.kprobes.register_kprobe(hook)
        self.hook = hook

    def _drop_hook(self) -> None:
        hook, self.hook = self.hook, None
        if hook is not None and hook.registered:
            self.kprobes.unregister_kprobe(hook)
        for va in list(self.points):
            self.points.remove(va)
        self.returns.by_task.clear()
        self.restarts.clear()
        self._pending.clear()

    # -- mappings --------------------------------------------------------------------------------
    def _vma_entry(self, kp: Kprobe, regs: PtRegs) -> int:
        """vma_set_page_prot(vma) is called: which vma (its argument is only sure at the entry)."""
        self._pending[regs.tid] = regs.arg(1)
        return 0

    def _vma_ready(self, kp: Kprobe, regs: PtRegs) -> None:
        vma = self._pending.pop(regs.tid, 0)
        if vma and self.spaces:
            found = self.files.vma_mapping(vma)
            if found is not None:
                self._arm_mapping(*found)

    def _arm_mapping(self, m: Mapping, space: int) -> None:
        if space not in self.spaces or not m.probeable:
            return
        if not self.files.still_there(self.spaces[space]):
            self._retire(space)  # the probed file is gone: this is another one in its inode's memory
            return
        for s, offset in self.probes:
            va = m.address_of(offset) if s == space else None
            if va is not None:
                self.points.add(va, (s, offset))
        if len(self.points) > 2 * self._after_collect + 16:
            self._collect()

    def _retire(self, space: int) -> None:
        """The probed file was freed (deleted, and no process maps it): its probes can never hit again.

        They stay registered (unregister_uprobe still takes them) but match nothing, even when a new file's
        inode takes the same memory; the kernel's would have kept the inode alive, and no process could have
        mapped it again either."""
        self.spaces.pop(space, None)
        for key in [key for key in self.probes if key[0] == space]:
            self.retired.extend(self.probes.pop(key))
        for va, point in list(self.points.items()):
            point.keys = {key for key in point.keys if key[0] != space}
            self.points.prune(va, point)

    def _collect(self) -> None:
        """Take out the breakpoints of addresses no mapping of a probed file holds now (exited processes)."""
        live: dict[int, set[tuple[int, int]]] = {}
        for space, f in list(self.spaces.items()):
            if not self.files.still_there(f):
                self._retire(space)
                continue
            for m in self.files.mappings(f):
                if not m.probeable:
                    continue
                for s, offset in self.probes:
                    va = m.address_of(offset) if s == space else None
                    if va is not None:
                        live.setdefault(va, set()).add((s, offset))
        for va, point in list(self.points.items()):
            point.keys = live.get(va, set())
            self.points.prune(va, point)
        self._after_collect = len(self.points)

    # -- hits --------------------------------------------------------------------------------------
    def _hit(self, tid: str, values: dict[str, int]) -> None:
        ip = self.arch.ip(values)
        point = self.points.get(ip)
        consumers: list[Uprobe] = []
        returned: list[ReturnInstance] = []
        code = b""
        root = sp = task = 0
        if point is not None and self.arch.user_mode(values):
            regs = {**values, self.arch.registers.percpu_base: self.arch.percpu_base(values)}
            root = self.machine.mem.pgd_of(values[self.arch.registers.task_page_table])
            sp = self.arch.sp(values)
            if (root, ip, sp) in self.restarts:
                self.restarts.discard((root, ip, sp))
            else:
                task = self.kernel.current_address(values)
                if point.returns:
                    returned = self.returns.returning(point, (root, task), ip, sp)
                if point.keys:
                    consumers, code = self._consumers_at(ip, root, task)
            values = regs
        pt = self.regs.make_regs(values, tid)
        for ri in returned:
            self.returns.run(ri, pt)
        if consumers:
            self._run_entry(consumers, pt, values, (root, task))
        changed = pt.dirty()
        if changed and pt.ip != ip:  # a handler moved the task elsewhere: the instruction is not run
            self.machine.gdb.write_registers(tid, changed)
            return
        performed = self._emulate(pt, root) if root else None
        if performed is not None:  # the handlers' registers and the instruction's in one write
            self.machine.gdb.write_registers(tid, {**changed, **performed})
            self.emulated += 1
            return
        if changed:
            self.machine.gdb.write_registers(tid, changed)
        self.stepped += 1
        after = self.stepper.step(tid, ip)
        if consumers and self.arch.uprobes and self.arch.uprobes.arch_uprobe_xol_was_trapped(code, after):
            if len(self.restarts) >= MAX_RESTARTS:
                self.restarts.clear()
            self.restarts.add((root, ip, sp))

    def _emulate(self, pt: PtRegs, root: int) -> dict[str, int] | None:
        """The instruction performed on the host where the architecture can, as the task would perform it (no
        step: its stop costs QEMU 7.2 a flush of its translated code): the registers it changed, for the
        caller to write, or None for the step.  Its memory is written here, before them.  An instruction
        the host performs faults nowhere, so it needs no restart."""
        uprobes = self.arch.uprobes
        assert uprobes is not None  # a uprobe's breakpoint stopped here
        post = copy.copy(pt)  # the emulation's own: one that gives up part way leaves it to the step
        post.mark_clean()
        if not uprobes.arch_uprobe_emulate(post, UserMemory(self.machine, root, uprobes.user_page_allows)):
            return None
        return post.dirty()

    def _consumers_at(self, ip: int, root: int, task: int) -> tuple[list[Uprobe], bytes]:
        """The probes on the file offset the stopped process runs at ``ip``, and the instruction's bytes."""
        try:
            phys = self.machine.mem.virt_to_phys(ip, root)
        except MemoryFault:
            return [], b""  # not present: the fetch faults, and the instruction comes back
        size = self.files.page_size
        owner = self.files.page_owner(phys // size)
        if owner is not None:
            space, index = owner
            offset = index * size + ip % size
        else:  # a private copy of the page (copy-on-write of text): the vma says what the process maps there
            mm = self.kernel.task(task).mm.value_() if task else 0
            found = self.files.mapping_at(mm, ip) if mm else None
            if found is None:
                return [], b""
            m, space = found
            offset = m.file_start + ip - m.start
        consumers = list(self.probes.get((space, offset), ())) if space in self.spaces else []
        code = self.machine.mem.read(ip, min(16, size - ip % size), root) if consumers else b""
        return consumers, code

    def _run_entry(self, consumers: list[Uprobe], pt: PtRegs, values: Regs[str, int],
                   key: tuple[int, int]) -> None:  # fmt: skip
        take_returns: list[Uprobe] = []
        for up in consumers:
            if up.filter is not None:
                keep = self.handlers.call(up, f"filter of {up.where()}", up.filter, up, pt)
                if not keep:
                    up.nfiltered += 1
                    continue
            up.nhit += 1
            if up.handler is not None:
                self.handlers.call(up, f"handler of {up.where()}", up.handler, up, pt)
            if up.ret_handler is not None:
                take_returns.append(up)
        if take_returns:
            self.returns.prepare(take_returns, pt, values, key)
