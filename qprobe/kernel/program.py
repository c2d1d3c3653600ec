"""The running guest kernel as a drgn ``Program``: typed data, drgn's helpers and stack traces.

drgn reads guest *physical* memory through qprobe's own reader (the shared
RAM file, or the stub's physical mode) and walks the page tables from
``swapper_pg_dir`` itself, as it does for a kdump.  What it needs to know
about the running kernel is the VMCOREINFO text the guest keeps at
``*vmcoreinfo_data`` (OSRELEASE, KERNELOFFSET, 5-level paging...); a kernel
built without CONFIG_CRASH_CORE has none, and qprobe writes the same lines
itself from vmlinux and the KASLR slide it found.  Types, variables and
stack traces then come from vmlinux's DWARF and ORC, KASLR undone by drgn.

What drgn keeps between reads of a live kernel: types, symbols and the ORC
and DWARF indexes (all from the vmlinux file, so they never go stale), and
nothing of guest memory: every translation starts its page-table walk
afresh, a reference ``Object`` reads memory each time a value is asked of
it, and only ``Object.read_()`` (or a value object such as ``current``'s
pointer) is a snapshot.  ``tests/vm/test_drgn.py`` checks values that change
between two hits.
"""

from __future__ import annotations

import re
import struct
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, overload

import drgn

from qprobe.arch import Arch
from qprobe.errors import MemoryFault, SymbolError
from qprobe.kernel.debuginfo import DWARF_FRAGMENT
from qprobe.kernel.ringbuffer import max_event_length
from qprobe.vmm.memory import GuestMemory

if TYPE_CHECKING:
    from qprobe.kernel.symbols import Symbols

_MASK = (1 << 64) - 1


def vmcoreinfo(symbols: Symbols, mem: GuestMemory, arch: Arch) -> bytes:
    """The guest's own VMCOREINFO text, or the same lines written from vmlinux and the slide."""
    if "vmcoreinfo_data" in symbols and "vmcoreinfo_size" in symbols:
        data = mem.read_u64(symbols.address("vmcoreinfo_data"))
        size = mem.read_u64(symbols.address("vmcoreinfo_size"))
        if data and 0 < size <= 1 << 16:  # filled by crash_save_vmcoreinfo_init() at boot
            text = mem.read(data, size)
            if b"OSRELEASE=" in text and b"KERNELOFFSET=" in text:
                return text
    return synthetic_vmcoreinfo(symbols, mem, arch)


def synthetic_vmcoreinfo(symbols: Symbols, mem: GuestMemory, arch: Arch, root: int | None = None) -> bytes:
    """The VMCOREINFO lines drgn reads, as kernel/crash_core.c and the arch's machine_kexec write them.

    ``root``: the virtual address of the page tables to walk instead of the kernel's own (which early
    boot has not built yet).
    """

    def address(name: str) -> int:
        return root if root is not None and name == mem.paging.kernel_root_symbol else symbols.address(name)

    sym = symbols.lookup("linux_banner")
    banner = symbols.file_bytes(sym.addr, sym.size)
    release = re.match(rb"Linux version (\S+)", banner)
    if release is None:
        raise SymbolError(f"{symbols.path.name}: linux_banner does not name a release: cannot describe the kernel")
    lines = [
        f"OSRELEASE={release.group(1).decode()}",
        f"BUILD-ID={symbols.build_id}",
        "PAGESIZE=4096",
        *arch.vmcoreinfo(address, mem.virt_to_phys, mem.read_u64, mem.paging),
        f"KERNELOFFSET={symbols.slide:x}",
    ]
    return ("\n".join(lines) + "\n").encode()


def open_program(symbols: Symbols, mem: GuestMemory, arch: Arch, info: bytes | None = None) -> drgn.Program:
    """A drgn Program over the live guest: physical memory through ``mem``'s reader, debug info from vmlinux.

    ``info`` is the VMCOREINFO text to describe the kernel with (default: ``vmcoreinfo()``'s).
    """
    prog = drgn.Program(drgn.Platform(drgn.Architecture[arch.drgn_architecture], drgn.PlatformFlags.IS_64_BIT
                                      | drgn.PlatformFlags.IS_LITTLE_ENDIAN))  # fmt: skip
    phys = mem.phys

    def read(address: int, count: int, offset: int, physical: bool) -> bytes:
        try:
            return phys.read_phys(address, count)
        except MemoryFault as exc:
            raise drgn.FaultError(str(exc), address) from None

    # The whole physical address space: the reader itself refuses what is not RAM (the PCI hole).
    prog.add_memory_segment(0, 1 << 52, read, physical=True)
    prog.set_linux_kernel_custom(vmcoreinfo(symbols, mem, arch) if info is None else info, True)
    try:
        prog.load_debug_info([str(symbols.path)])
    except drgn.MissingDebugInfoError:
        pass  # loaded modules without debug info are reported too: only vmlinux's own matters, below
    try:
        usable = not prog.main_module().wants_debug_file()
    except LookupError:
        usable = False
    if not usable:
        raise SymbolError(f"{symbols.path.name} has no DWARF debug info that drgn can use: kernel types, variables "
                          f"and stack traces need it (probes work without); build the kernel with {DWARF_FRAGMENT} "
                          f"(a config fragment), or use a -dbg vmlinux")  # fmt: skip
    return prog


@dataclass(frozen=True)
class Task:
    """A snapshot of a guest task, taken at a hit: its address, pid (thread id), tgid and comm."""

    addr: int
    pid: int
    tgid: int
    comm: str

    def __str__(self) -> str:
        return f"{self.comm}-{self.pid}"


class Stack(Sequence[drgn.StackFrame]):
    """A kernel stack, innermost first: drgn's frames, an inlined call as a frame of its own.

    ``str()`` prints it as drgn prints a ``StackTrace``: ``#0  ksys_lseek (fs/read_write.c:380:9)``.
    """

    def __init__(self, frames: Sequence[drgn.StackFrame]) -> None:
        self.frames = tuple(frames)

    @overload
    def __getitem__(self, i: int) -> drgn.StackFrame: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[drgn.StackFrame]: ...
    def __getitem__(self, i: int | slice) -> drgn.StackFrame | Sequence[drgn.StackFrame]:
        return self.frames[i]

    def __len__(self) -> int:
        return len(self.frames)

    def __iter__(self) -> Iterator[drgn.StackFrame]:
        return iter(self.frames)

    def __str__(self) -> str:
        return "\n".join(f"#{i:<2} {describe(frame)}" for i, frame in enumerate(self.frames))

    def __repr__(self) -> str:
        return f"<Stack of {len(self.frames)} frames>"


def _s32(raw: bytes, offset: int) -> int:
    return int.from_bytes(raw[offset : offset + 4], "little", signed=True)  # pid_t


def describe(frame: drgn.StackFrame) -> str:
    """``name (file:line:column)`` where DWARF knows the frame, else ``symbol+0xoff/0xsize``, else the pc."""
    where: str | None = frame.function_name
    if where is None:  # no DWARF for this pc (entry code, a module): the ELF symbol, as /proc/PID/stack
        try:
            sym = frame.symbol()
            where = f"{sym.name}+{frame.pc - sym.address:#x}/{sym.size:#x}"
        except LookupError:
            where = f"{frame.pc:#x}"
    try:
        file, line, column = frame.source()
    except LookupError:
        return where
    return f"{where} ({file}:{line}:{column})" if column else f"{where} ({file}:{line})"


class KernelData:
    """The guest kernel's data through drgn, for handlers, events and the shell.

    The Program is created on first use (about 0.3 s for Debian's debug
    vmlinux) and kept for the life of the target.
    """

    def __init__(self, symbols: Symbols, mem: GuestMemory, arch: Arch) -> None:
        self.symbols = symbols
        self.mem = mem
        self.arch = arch
        layout = arch.registers
        self._pt_regs = struct.Struct(f"<{len(layout.pt_regs)}Q")
        # drgn's DWARF register names (the gdbstub's) for the frame registers that go back into a pt_regs.
        self._dwarf_to_pt = {g: layout.pt_name[g] for g in layout.unwound}
        self._lock = threading.Lock()
        self._prog: drgn.Program | None = None
        self._unusable: str | None = None  # why drgn cannot be used, found once
        self._params: dict[int, list[str]] = {}  # by function address
        self._event_length_limit: int | None = None  # 0: not known
        # During boot, before the kernel has built its own page tables: the virtual address of those the
        # boot CPU runs on, for drgn to walk (None: the kernel's own).
        self.early_root: int | None = None

    @property
    def prog(self) -> drgn.Program:
        if self._prog is None:
            with self._lock:
                if self._unusable is not None:
                    raise SymbolError(self._unusable)
                if self._prog is None:
                    try:
                        info = None
                        if self.early_root is not None:
                            info = synthetic_vmcoreinfo(self.symbols, self.mem, self.arch, self.early_root)
                        self._prog = open_program(self.symbols, self.mem, self.arch, info)
                    except SymbolError as exc:
                        self._unusable = str(exc)
                        raise
        return self._prog

    def reopen(self) -> None:
        """Forget the drgn Program: the next use makes it anew, from the kernel as it is by then
        (one opened early in boot read a VMCOREINFO and page tables that boot replaces)."""
        with self._lock:
            self._prog = None
            self._unusable = None
            self.early_root = None

    def close(self) -> None:
        """Let go of the drgn Program (hundreds of MB of native memory for a distribution's vmlinux) at once:
        the target it served is closed, and whatever still refers to this object (a cycle among the closed
        target's parts, freed only by Python's full collection) should not keep the Program alive with it."""
        with self._lock:
            self._prog = None
            self._params.clear()
            self._unusable = "the target is closed"

    def type_offset(self, type_name: str, member: str) -> int:
        """offsetof(type, member) from the debug info (``member`` may be a path: ``name.nodename``)."""
        try:
            return drgn.offsetof(self.prog.type(type_name), member)  # type: ignore[no-any-return]  # drgn: untyped to mypy
        except LookupError as exc:
            raise SymbolError(f"{type_name}.{member}: {exc}") from None

    def event_length_limit(self) -> int | None:
        """The longest record the guest's ring buffer takes (qprobe.kernel.ringbuffer); None when this
        kernel's types cannot say, and then no hit is refused for its length."""
        if self._event_length_limit is None:
            try:
                self._event_length_limit = max_event_length(self.prog)
            except (SymbolError, LookupError):
                self._event_length_limit = 0
            except drgn.FaultError:  # early in boot, before the buffer is allocated: asked again later
                return None
        return self._event_length_limit or None

    # -- current -------------------------------------------------------------------------
    def percpu_offset(self, name: str) -> int:
        """The per-CPU offset of a per-CPU variable, among them x86's hot ones (``current_task``, ``cpu_number``...).

        Linux up to 6.1 has each of those as a per-CPU variable; 6.2 gathered them into
        ``struct pcpu_hot`` ("x86/percpu: Move current_task to pcpu_hot" and its
        siblings); 6.15 made them per-CPU variables of their own again, in a
        cache-hot section.  Whichever this kernel's debug info has.
        """
        try:
            prog = self.prog
        except SymbolError:
            if name in self.symbols.percpu:  # no debug info: the ELF symbol table still has the variable
                return self.symbols.percpu[name]
            raise
        try:
            return prog[name].address_  # type: ignore[no-any-return]  # drgn: untyped to mypy
        except KeyError:
            pass
        try:
            hot = prog["pcpu_hot"]
            return hot.address_ + drgn.offsetof(hot.type_, name)  # type: ignore[no-any-return]  # drgn: untyped to mypy
        except (KeyError, LookupError):
            raise SymbolError(f"this kernel has neither a per-CPU {name} nor pcpu_hot.{name}") from None

    @cached_property
    def current_task_offset(self) -> int:
        """The per-CPU offset of the running task's pointer (``RegisterLayout.current_percpu``: x86's
        ``current_task``, arm64's ``__entry_task``)."""
        return self.percpu_offset(self.arch.registers.current_percpu)

    @cached_property
    def offsets(self) -> tuple[int, int, int, int]:
        """For code generated into the guest: per-CPU offset of current, offsetof task_struct pid, tgid, comm."""
        task = self.prog.type("struct task_struct")
        return (self.current_task_offset, drgn.offsetof(task, "pid"), drgn.offsetof(task, "tgid"),
                drgn.offsetof(task, "comm"))  # fmt: skip

    def current_address(self, regs: Mapping[str, int], read_u64: Callable[[int], int] | None = None) -> int:
        """The address of ``current``'s task_struct on a vCPU stopped with registers ``regs`` (gdbstub names).

        At a kernel-mode stop, the register that holds it where the architecture keeps it in one
        (``RegisterLayout.current``: arm64's SP_EL0); else (a user-mode stop there, every stop on x86)
        the per-CPU variable ``RegisterLayout.current_percpu`` at the per-CPU base (``Arch.percpu_base``:
        x86's GS base), read with ``read_u64`` (default: through drgn).
        """
        register = self.arch.registers.current
        if register is not None and not self.arch.user_mode(regs):
            return regs[register]
        # Modulo 2**64, as the CPU adds: arm64's per-CPU base (__per_cpu_offset) is the distance from the
        # variable's address in the image to its copy in the linear map, a "negative" number.
        address = (self.arch.percpu_base(regs) + self.current_task_offset) & _MASK
        if read_u64 is not None:
            return read_u64(address)
        task: int = drgn.Object(self.prog, "unsigned long", address=address).value_()
        return task

    def current(self, regs: Mapping[str, int]) -> drgn.Object:
        """``current`` on a vCPU stopped in kernel mode with registers ``regs``: a task_struct pointer."""
        return self.task(self.current_address(regs))

    def task(self, addr: int) -> drgn.Object:
        return drgn.Object(self.prog, "struct task_struct *", value=addr)

    def read_task(self, addr: int | None = None, *, regs: Mapping[str, int] | None = None) -> Task:
        """A Task of the task_struct at ``addr`` (else of ``current`` on the vCPU with registers ``regs``).

        pid, tgid and comm are read in one read of the span that holds them (at the offsets the
        debug info gives), not member by member: one page walk instead of three (under 20 µs).
        """
        task = self.current_address(regs or {}) if addr is None else addr
        _cur, pid, tgid, comm = self.offsets
        lo = min(pid, tgid, comm)
        raw = self.prog.read(task + lo, max(pid, tgid, comm) + 16 - lo)
        name = raw[comm - lo : comm - lo + 16].split(b"\0")[0].decode(errors="replace")
        return Task(task, _s32(raw, pid - lo), _s32(raw, tgid - lo), name)

    def snapshot(self, addr: int | None = None, *, regs: Mapping[str, int] | None = None) -> Task | None:
        """``read_task``, or None when the kernel's types are unavailable (a vmlinux without DWARF) or the
        task cannot be read: what a kretprobe instance records, which must not stop the probe.
        """
        try:
            return self.read_task(addr, regs=regs)
        except (SymbolError, drgn.FaultError):
            return None

    # -- functions -------------------------------------------------------------------------
    def params(self, function: str, address: int) -> list[str]:
        """The parameter names, in order, of the function ``function`` whose code starts at ``address``.

        Static functions may share a name: where the name alone finds another one, the one at
        ``address`` is looked up in its own source file (a header's function copied into several
        files is one definition, whichever copy is found).  GCC's clones (``.constprop.0``...)
        have no debug info of their own: their parameters are not the source's.
        """
        if address not in self._params:
            try:
                fn = self.prog.function(function)
                if fn.address_ != address:
                    fn = self.prog.function(function, self.prog.source_location(address)[-1].filename)
            except LookupError:
                raise SymbolError(f"no debug info for the function {function}") from None
            self._params[address] = [p.name or f"arg{i + 1}" for i, p in enumerate(fn.type_.parameters)]
        return self._params[address]

    # -- stacks ----------------------------------------------------------------------------
    def pt_regs(self, values: dict[str, int]) -> drgn.Object:
        """A ``struct pt_regs`` value holding pt_regs-named registers (absent ones are zero)."""
        raw = self._pt_regs.pack(*(values.get(name, 0) & _MASK for name in self.arch.registers.pt_regs))
        # The fields past the registers the layout names (arm64's orig_x0 ... exit_rcu) are zero.
        size = drgn.sizeof(self.prog.type("struct pt_regs"))
        return drgn.Object.from_bytes_(self.prog, "struct pt_regs", raw.ljust(size, b"\0"))

    def stack_trace(self, values: dict[str, int], fix_return: Callable[[int, int], int] | None = None,
                    max_frames: int = 64) -> Stack:  # fmt: skip
        """drgn's trace from registers (pt_regs names), through kretprobe trampolines.

        A return address that is one of our trampolines (``fix_return(sp, value)``, with the stack
        pointer the frame returned to, gives the real one) stops drgn, which has no unwind data for it: the walk
        goes on from that frame's registers with the real return address, as the
        kernel's own unwinder does with kretprobe_find_ret_addr().
        """
        frames: list[drgn.StackFrame] = []
        regs = values
        while len(frames) < max_frames:
            trace = self.prog.stack_trace(self.pt_regs(regs))
            resume = None
            for frame in trace:
                if len(frames) == max_frames or not frame.pc >> 63:
                    break  # the kernel stack ends where the task entered the kernel from user mode
                real = fix_return(frame.sp, frame.pc) if fix_return is not None and not frame.is_inline else None
                if real is not None and real != frame.pc:
                    # The trampoline took the place of the return address (on the stack, or in a register).
                    resume = {self._dwarf_to_pt[k]: v for k, v in frame.registers().items() if k in self._dwarf_to_pt}
                    resume[self.arch.registers.ip] = real
                    break
                frames.append(frame)
            if resume is None:
                break
            regs = resume
        return Stack(frames)
