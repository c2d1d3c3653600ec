"""User-space probes as the kernel's uprobes (kernel/events/uprobes.c), from the host: nothing written into the guest.

A uprobe is keyed as the kernel keys it, by (file, offset): the file's ``address_space`` and a byte offset
in it.  The kernel writes an int3 into a private copy of the page in every mm that maps the file and runs
the displaced instruction out of line in a per-mm page; qprobe needs neither.  It puts one of the gdbstub's
own breakpoints (nothing written under TCG) at every virtual address where some process maps the offset,
and decides at each stop whether the process that stopped really runs that file there:

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
* **returns:** a return probe's entry reads the return address and puts a breakpoint there; the return is
  the stop of the same task, in the same address space, with the stack pointer the return leaves.  Frames
  a task left without returning (``longjmp``) are dropped when it calls from an outer one (the kernel's
  ``cleanup_return_instances``) or returns from one (its ``handle_trampoline``); at most MAX_URETPROBE_DEPTH
  live per task, as in the kernel.

The page cache, ``read()`` of the file, ``/proc/PID/mem`` and the disk all keep the original bytes: there
is no int3 anywhere in the guest.  Every hit is two VM stops (the stop and the step), in any process that
runs the address, so a busy probe costs what an anywhere kprobe costs.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping as Regs
from dataclasses import dataclass, field
from typing import Any

from qprobe.arch import Arch
from qprobe.core.handlers import Handlers
from qprobe.core.kprobe import Kprobe
from qprobe.core.regs import PtRegs
from qprobe.errors import InvalidProbe, MemoryFault, QprobeError
from qprobe.kernel.program import KernelData
from qprobe.kernel.ufile import GuestFile, Mapping, UserFiles
from qprobe.kernel.userelf import UserElf, UserElfError
from qprobe.vmm.machine import Machine

__all__ = ["MAX_URETPROBE_DEPTH", "Uprobe", "UprobeManager", "Uretprobe"]

UprobeHandler = Callable[["Uprobe", PtRegs], Any]
RetHandler = Callable[["Uprobe", int, PtRegs], Any]
UprobeFilter = Callable[["Uprobe", PtRegs], bool]

# kernel/events/uprobes.c: return instances a task may hold; deeper calls go unprobed (counted in nmissed).
MAX_URETPROBE_DEPTH = 64
MAX_TASKS_WITH_RETURNS = 4096  # tasks whose return instances are kept (the oldest beyond it are dropped)
MAX_RESTARTS = 1024
MAX_ELF = 256 << 20  # a file read whole for its symbols (libc is 2 MB)
# The hook on new mappings: mmap_region() ends with vma_set_page_prot(vma) on the vma it made or grew,
# after linking it into the file's i_mmap, beside uprobe_mmap(vma) (mm/mmap.c, Linux 4.x to 6.12: 6.12's
# __mmap_region too); mprotect_fixup() calls it for a vma whose protection changed.
MMAP_HOOK = "vma_set_page_prot"


class Uprobe:
    """A probe on one instruction of a file, in every process that maps it: ``struct uprobe_consumer``'s words.

    Give ``offset`` (bytes into the file) or ``symbol`` (``NAME`` or ``NAME+OFFS``, from the file's ELF
    symbols).  ``handler(up, regs)`` runs at the instruction with the process's user registers
    (``regs.read`` reads its memory); ``ret_handler(up, func, regs)`` when the function the probe is at
    returns (``func`` the probed address, ``regs_return_value(regs)`` its value).  ``filter(up, regs)``
    decides per hit whether the handlers run (the kernel asks it per mm); a hit it refuses is counted in
    ``nfiltered`` only.
    """

    def __init__(self, path: str, offset: int | None = None, symbol: str | None = None,
                 handler: UprobeHandler | None = None, ret_handler: RetHandler | None = None,
                 filter: UprobeFilter | None = None) -> None:  # fmt: skip
        if not isinstance(path, str) or not path.startswith("/"):
            raise InvalidProbe(f"a uprobe's path must be absolute, not {path!r} (EINVAL)")
        if (offset is None) == (symbol is None):
            raise InvalidProbe("give a uprobe an offset or a symbol, one of them (EINVAL)")
        if offset is not None and (not isinstance(offset, int) or offset < 0):
            raise InvalidProbe(f"a uprobe's offset must be a non-negative int, not {offset!r} (EINVAL)")
        for name, fn in (("handler", handler), ("ret_handler", ret_handler), ("filter", filter)):
            if fn is not None and not callable(fn):
                raise InvalidProbe(f"{name} must be callable, not {type(fn).__name__} (EINVAL)")
        self.path = path
        self.offset = offset
        self.symbol = symbol
        self.handler = handler
        self.ret_handler = ret_handler
        self.filter = filter
        self.nhit = 0  # hits that ran the handlers (the filter let them)
        self.nfiltered = 0
        self.nmissed = 0  # returns not probed: the task already held MAX_URETPROBE_DEPTH instances
        self.nreturns = 0
        self.nfaults = 0
        self.errors: list[str] = []
        self.registered = False
        self.file: GuestFile | None = None

    def where(self) -> str:
        at = f"{self.offset:#x}" if self.offset is not None else str(self.symbol)
        return f"{self.path}:{at}"

    def __repr__(self) -> str:
        kind = "Uretprobe" if self.handler is None and self.ret_handler is not None else "Uprobe"
        return f"<{kind} {self.where()} nhit={self.nhit} nmissed={self.nmissed}>"


class Uretprobe(Uprobe):
    """A return probe on a function of a file: a Uprobe with only ``ret_handler`` (``uretprobe`` events)."""

    def __init__(self, path: str, offset: int | None = None, symbol: str | None = None,
                 ret_handler: RetHandler | None = None, filter: UprobeFilter | None = None) -> None:  # fmt: skip
        super().__init__(path, offset, symbol, ret_handler=ret_handler or _no_return_handler, filter=filter)


def _no_return_handler(up: Uprobe, func: int, regs: PtRegs) -> None:
    """A Uretprobe without a handler still counts its returns."""


@dataclass
class _Return:
    """One call of a return-probed function in flight (the kernel's ``return_instance``)."""

    probes: list[Uprobe]
    func: int
    ret_addr: int
    sp_after: int


@dataclass
class _Point:
    """A virtual address with a stub breakpoint: the probed offsets some mapping puts there, and returns."""

    keys: set[tuple[int, int]] = field(default_factory=set)  # (address_space, offset)
    returns: int = 0  # live return instances waiting here


class UprobeManager:
    """The uprobes of one target; every method that changes state runs on the stop loop."""

    def __init__(self, machine: Machine, arch: Arch, kernel: KernelData, handlers: Handlers,
                 make_regs: Callable[[Regs[str, int], str], PtRegs], step: Callable[[str, int], dict[str, int]],
                 register_kprobe: Callable[[Kprobe], None],
                 unregister_kprobe: Callable[[Kprobe], None]) -> None:  # fmt: skip
        self.machine, self.arch = machine, arch
        self.kernel = kernel
        self.handlers = handlers
        self.make_regs = make_regs
        self.step = step
        self.register_kprobe = register_kprobe
        self.unregister_kprobe = unregister_kprobe
        self._elves: dict[tuple[int, int], UserElf] = {}  # (inode, size) -> its ELF, read once
        self._files: UserFiles | None = None
        self.probes: dict[tuple[int, int], list[Uprobe]] = {}  # (address_space, offset) -> consumers
        self.spaces: dict[int, GuestFile] = {}  # address_space -> the file, while some probe is on it
        self.points: dict[int, _Point] = {}
        self.returns: dict[tuple[int, int], list[_Return]] = {}  # (page-table root, task) -> its calls
        self.restarts: set[tuple[int, int, int]] = set()  # (root, ip, sp) of a probed instruction that faulted
        self.hook: Kprobe | None = None
        self.retired: list[Uprobe] = []  # registered on a file since freed: they match nothing
        self._pending: dict[str, int] = {}  # vCPU -> the vma its vma_set_page_prot() call is given
        self._after_collect = 0

    @property
    def files(self) -> UserFiles:
        if self._files is None:
            self._files = UserFiles(self.kernel.prog)
        return self._files

    # -- registration -------------------------------------------------------------------------
    def register_uprobe(self, up: Uprobe) -> None:
        if up.registered:
            raise InvalidProbe(f"{up.where()} is already registered (EINVAL)")
        self.machine.call(lambda: self._register(up))

    def unregister_uprobe(self, up: Uprobe) -> None:
        if not up.registered:
            raise InvalidProbe(f"{up.where()} is not registered (EINVAL)")
        self.machine.call(lambda: self._unregister(up))

    def registered(self) -> list[Uprobe]:
        return [*(up for consumers in self.probes.values() for up in consumers), *self.retired]

    def remove_all(self) -> None:
        for up in self.registered():
            self.unregister_uprobe(up)

    def _register(self, up: Uprobe) -> None:
        f = self.files.lookup(up.path)
        if f is None:
            raise InvalidProbe(f"{up.path}: no regular file there in the guest's dentry cache (ENOENT)")
        offset = up.offset if up.offset is not None else self._symbol_offset(f, str(up.symbol))
        # uprobe_register(): an offset past the end of the file is EINVAL.
        if offset > f.size:
            raise InvalidProbe(f"{up.path}:{offset:#x} is past the end of the file ({f.size} bytes) (EINVAL)")
        code, ua = self.files.read(f, offset, 16), self.arch.uprobes  # ua None: the arch has no user-space probes
        why = (ua.arch_uprobe_analyze_insn(code) if code else None) if ua else "not on this architecture (ENOTSUPP)"
        if why is not None:
            raise InvalidProbe(f"{up.path}:{offset:#x}: {why}")
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
                self._add(va, key)

    def _symbol_offset(self, f: GuestFile, symbol: str) -> int:
        try:
            return self._elf(f).resolve(symbol)
        except UserElfError as exc:
            raise InvalidProbe(str(exc)) from None

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
        for stack in self.returns.values():
            for ri in stack:
                if up in ri.probes:
                    ri.probes.remove(up)
        if consumers:
            return
        del self.probes[key]
        if not any(space == up.file.mapping for space, _ in self.probes):
            self.spaces.pop(up.file.mapping, None)
        for va, point in list(self.points.items()):
            point.keys.discard(key)
            self._maybe_remove(va, point)
        if not self.probes:
            self._drop_hook()

    def _ensure_hook(self) -> None:
        if self.hook is not None and self.hook.registered:
            return
        if MMAP_HOOK not in self.kernel.symbols:
            raise InvalidProbe(f"uprobes follow new mappings at {MMAP_HOOK}(), which this kernel does not have")
        # A post_handler keeps the probe on its int3 (a probe with one is never jump-optimized), so both
        # handlers run on the stop loop with every vCPU stopped: the breakpoints are in before the task runs on.
        hook = Kprobe(symbol_name=MMAP_HOOK, pre_handler=self._vma_entry, post_handler=self._vma_ready)
        self.register_kprobe(hook)
        self.hook = hook

    def _drop_hook(self) -> None:
        hook, self.hook = self.hook, None
        if hook is not None and hook.registered:
            self.unregister_kprobe(hook)
        for va in list(self.points):
            self._remove(va)
        self.returns.clear()
        self.restarts.clear()
        self._pending.clear()

    # -- addresses -------------------------------------------------------------------------------
    def _add(self, va: int, key: tuple[int, int] | None) -> None:
        point = self.points.get(va)
        if point is None:
            point = self.points[va] = _Point()
            self.machine.insert_stub_breakpoint(va)
            self.machine.stop_handlers[va] = self._hit
        if key is not None:
            point.keys.add(key)

    def _maybe_remove(self, va: int, point: _Point) -> None:
        if not point.keys and not point.returns:
            self._remove(va)

    def _remove(self, va: int) -> None:
        self.points.pop(va, None)
        self.machine.stop_handlers.pop(va, None)
        self.machine.remove_stub_breakpoint(va)

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
                self._add(va, (s, offset))
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
            self._maybe_remove(va, point)

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
            self._maybe_remove(va, point)
        self._after_collect = len(self.points)

    # -- hits --------------------------------------------------------------------------------------
    def _hit(self, tid: str, values: dict[str, int]) -> None:
        ip = self.arch.ip(values)
        point = self.points.get(ip)
        consumers: list[Uprobe] = []
        returned: list[_Return] = []
        code = b""
        root = sp = task = 0
        if point is not None and self.arch.user_mode(values):
            regs = {**values, self.arch.registers.percpu_base: self.arch.percpu_base(values)}
            root = self.machine.mem.pgd_of(values[self.arch.registers.page_table])
            sp = self.arch.sp(values)
            if (root, ip, sp) in self.restarts:
                self.restarts.discard((root, ip, sp))
            else:
                task = self.kernel.current(self.arch.percpu_base(values)).value_()
                if point.returns:
                    returned = self._returns_at(point, (root, task), ip, sp)
                if point.keys:
                    consumers, code = self._consumers_at(ip, root, task)
            values = regs
        pt = self.make_regs(values, tid)
        for ri in returned:
            self._run_returns(ri, pt)
        if consumers:
            self._run_entry(consumers, pt, values, (root, task))
        changed = pt.dirty()
        if changed:
            self.machine.gdb.write_registers(tid, changed)
            if pt.ip != ip:  # a handler moved the task elsewhere: the instruction is not run
                return
        after = self.step(tid, ip)
        if consumers and self.arch.uprobes and self.arch.uprobes.arch_uprobe_xol_was_trapped(code, after):
            if len(self.restarts) >= MAX_RESTARTS:
                self.restarts.clear()
            self.restarts.add((root, ip, sp))

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
            self._prepare_return(take_returns, pt, values, key)

    # -- returns ---------------------------------------------------------------------------------
    def _prepare_return(self, probes: list[Uprobe], pt: PtRegs, values: Regs[str, int],
                        key: tuple[int, int]) -> None:  # fmt: skip
        """prepare_uretprobe(): remember the call and stop at its return address (values: before any handler)."""
        assert self.arch.uprobes is not None  # a uprobe was registered
        try:
            ret_addr, sp_after = self.arch.uprobes.arch_uretprobe_frame(values, pt.read)
        except QprobeError:
            for up in probes:
                up.nmissed += 1
            return
        stack = self.returns.get(key)
        if stack is None:
            if len(self.returns) >= MAX_TASKS_WITH_RETURNS:
                self._forget(next(iter(self.returns)))
            stack = self.returns[key] = []
        if len(stack) >= MAX_URETPROBE_DEPTH:
            for up in probes:
                up.nmissed += 1
            return
        # cleanup_return_instances() at a call: the calls of frames below this one's were left without
        # returning (longjmp).  One of this very frame stays, as the kernel keeps it for a tail call (it
        # tells that from a new call by its trampoline in the return slot; qprobe writes none there).
        while stack and stack[-1].sp_after < sp_after:
            self._release(stack.pop())
        stack.append(_Return(list(probes), self.arch.ip(values), ret_addr, sp_after))
        self._add(ret_addr, None)
        self.points[ret_addr].returns += 1

    def _returns_at(self, point: _Point, key: tuple[int, int], ip: int, sp: int) -> list[_Return]:
        """The calls of this task that return here now; calls it left without returning are dropped."""
        stack = self.returns.get(key)
        out: list[_Return] = []
        while stack:
            top = stack[-1]
            if top.sp_after > sp:
                break
            stack.pop()
            self._release(top)
            if top.sp_after == sp and top.ret_addr == ip:
                out.append(top)
        if stack is not None and not stack:
            del self.returns[key]
        return out

    def _run_returns(self, ri: _Return, pt: PtRegs) -> None:
        for up in ri.probes:
            up.nreturns += 1
            if up.ret_handler is not None:
                self.handlers.call(up, f"ret_handler of {up.where()}", up.ret_handler, up, ri.func, pt)

    def _release(self, ri: _Return) -> None:
        point = self.points.get(ri.ret_addr)
        if point is not None:
            point.returns -= 1
            self._maybe_remove(ri.ret_addr, point)

    def _forget(self, key: tuple[int, int]) -> None:
        for ri in self.returns.pop(key, []):
            self._release(ri)
