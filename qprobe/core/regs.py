"""pt_regs on the host: what a handler sees and may change.

Names follow the kernel's ``struct pt_regs`` (``regs.ax``, ``regs.di``,
``regs.ip``, ``regs.flags``); a write marks the register dirty and the
dispatcher writes exactly the dirty ones back before the vCPU resumes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, ClassVar, Protocol

from qprobe.errors import SymbolError
from qprobe.vmm.memory import GuestMemory

if TYPE_CHECKING:
    from qprobe.arch import RegisterLayout
    from qprobe.kernel.program import KernelData, Stack
    from qprobe.kernel.symbols import Symbols

_MASK = (1 << 64) - 1
# The portable names of the instruction pointer, stack pointer and flags, as the kernel's
# instruction_pointer(), user_stack_pointer() and regs->flags/pstate reach them on every architecture:
# on arm64 ``regs.ip`` is pt_regs' ``pc`` and ``regs.flags`` its ``pstate``.
_PORTABLE = ("ip", "sp", "flags")


def _portable(name: str) -> property:
    """Register ``name`` of the layout's (``RegisterLayout.ip``/``sp``/``flags``), by its portable name."""

    def get(self: PtRegs) -> int:
        return self._values[getattr(self._layout, name)]

    return property(get)


def _register(name: str) -> property:
    """A read of register ``name``: a class attribute, so it skips ``__getattr__``'s failed lookup first."""

    def get(self: PtRegs) -> int:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"pt_regs has no register {name!r}") from None

    return property(get)


class PtRegs:
    """A vCPU's registers at a probe hit.

    ``vcpu`` is the 0-based vCPU number (the kernel's smp_processor_id()
    under QEMU), ``tid`` the stub's thread id.
    """

    __slots__ = ("_dirty", "_kernel", "_layout", "_mem", "_pgd", "_symbols", "_system", "_values", "cycles",
                 "fix_return", "task_regs", "tid", "vcpu")  # fmt: skip
    # The layout whose registers are class attributes (one per architecture, added on first use: a
    # read through __getattr__ costs a failed lookup first, several times a plain attribute's, on every hit).
    _read_for: ClassVar[RegisterLayout | None] = None
    # The slots' types (set through object.__setattr__ in __init__; without these a type checker
    # would take every attribute for a register, as __getattr__ answers).
    _dirty: set[str]
    _kernel: KernelData | None
    _layout: RegisterLayout
    _mem: GuestMemory
    _pgd: int
    _symbols: Symbols | None
    _system: dict[str, int]
    _values: dict[str, int]
    fix_return: Callable[[int, int], int] | None
    task_regs: dict[str, int]
    tid: str
    cycles: int | None
    vcpu: int

    ip = _portable("ip")
    sp = _portable("sp")
    flags = _portable("flags")

    def __init__(self, values: dict[str, int], tid: str, vcpu: int, mem: GuestMemory,
                 symbols: Symbols | None = None, kernel: KernelData | None = None,
                 fix_return: Callable[[int, int], int] | None = None, *, layout: RegisterLayout) -> None:  # fmt: skip
        if PtRegs._read_for is not layout:
            PtRegs._add_reads(layout)
        regs = {pt: values[g] for pt, g in layout.gdb_name.items() if g in values}
        # A detour's frame has no segment registers; probed code runs in kernel mode, where they
        # have the values the layout gives (what the kernel's own probes record, ftrace-based ones too).
        for name, value in layout.defaults.items():
            regs.setdefault(name, value)
        # Slots are set directly: __setattr__ is the handlers' path (a PtRegs is built for every hit).
        init = object.__setattr__
        init(self, "_layout", layout)
        init(self, "_values", regs)
        # The stop's system registers (arm64's ELR_EL1, SPSR_EL1...): read as attributes, never written
        # (QEMU 7.2's stub writes none), and no pt_regs field (as_dict and dirty leave them out).
        init(self, "_system", {name: values[name] for name in layout.system if name in values})
        init(self, "_dirty", set())
        init(self, "_mem", mem)
        init(self, "_symbols", symbols)
        init(self, "_kernel", kernel)
        # Reads use the interrupted task's page tables, so user pointers work too (arm64: its TTBR0's, for
        # the user half; GuestMemory walks the kernel half from the kernel's root).
        root = values.get(layout.task_page_table)
        init(self, "_pgd", mem.pgd if root is None else mem.pgd_of(root))
        init(self, "tid", tid)
        init(self, "vcpu", vcpu)
        # What the kernel layer finds ``current`` from (KernelData.current_address), by gdbstub name: the
        # per-CPU base in kernel mode (x86's GS base, arm64's TPIDR_EL1; 0 where the hit did not bring it),
        # and where the architecture keeps ``current`` in a register in kernel mode (arm64's SP_EL0), the
        # stop's registers, which say the mode (Arch.user_mode) that decides between the two.
        task_regs = {layout.percpu_base: values.get(layout.percpu_base, 0)}
        if layout.current is not None and layout.current in values:
            task_regs = {**values, **task_regs}
        init(self, "task_regs", task_regs)
        # The architecture's cycle counter (Arch.cycle_counter's; x86's TSC) at the hit where the guest read
        # it (a detour's mailbox or ring entry), else None.
        init(self, "cycles", values.get("cycles"))
        # Maps a return address a frame returns to to the real one (kretprobe trampolines).
        init(self, "fix_return", fix_return)

    @classmethod
    def _add_reads(cls, layout: RegisterLayout) -> None:
        for name in layout.gdb_name:
            if name not in cls.__dict__:
                setattr(cls, name, _register(name))
        cls._read_for = layout

    def __getattr__(self, name: str) -> int:
        if name.startswith("_"):  # during copy/pickle _values does not exist yet
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            pass
        try:
            return self._system[name]
        except KeyError:
            raise AttributeError(f"pt_regs has no register {name!r}") from None

    def __setattr__(self, name: str, value: int) -> None:
        if name in PtRegs.__slots__:
            object.__setattr__(self, name, value)
            return
        if name in _PORTABLE:
            name = getattr(self._layout, name)
        if name not in self._layout.gdb_name:
            raise AttributeError(f"pt_regs has no register {name!r}")
        if not isinstance(value, int):
            raise TypeError(f"regs.{name} must be an int, not {type(value).__name__}")
        self._values[name] = value & _MASK
        self._dirty.add(name)

    def __copy__(self) -> PtRegs:
        """A snapshot: later changes to either object do not show in the other."""
        twin = object.__new__(PtRegs)
        for name in PtRegs.__slots__:
            object.__setattr__(twin, name, getattr(self, name))
        object.__setattr__(twin, "_values", dict(self._values))
        object.__setattr__(twin, "_dirty", set(self._dirty))
        return twin

    @property
    def percpu_base(self) -> int:
        """The CPU's per-CPU base in kernel mode (0 where the hit did not bring it)."""
        return self.task_regs[self._layout.percpu_base]

    def as_dict(self) -> dict[str, int]:
        return dict(self._values)

    def dirty(self) -> dict[str, int]:
        """gdbstub name -> value of every register a handler changed."""
        return {self._layout.gdb_name[n]: self._values[n] for n in self._dirty}

    def set_quietly(self, name: str, value: int) -> None:
        """Change a register as the dispatcher (not the user) sees it."""
        self._values[getattr(self._layout, name) if name in _PORTABLE else name] = value & _MASK

    def mark_clean(self) -> None:
        self._dirty.clear()

    # -- memory ----------------------------------------------------------------
    def read(self, addr: int, size: int) -> bytes:
        """Guest memory through the interrupted task's page tables (raises MemoryFault)."""
        return self._mem.read(addr, size, self._pgd)

    def read_u64(self, addr: int) -> int:
        return int.from_bytes(self.read(addr, 8), "little")

    def read_u32(self, addr: int) -> int:
        return int.from_bytes(self.read(addr, 4), "little")

    def read_string(self, addr: int, limit: int = 4096) -> str:
        out = bytearray()
        while len(out) < limit:
            chunk = self.read(addr + len(out), min(64, limit - len(out), 4096 - ((addr + len(out)) & 0xFFF)))
            nul = chunk.find(b"\0")
            if nul >= 0:
                out += chunk[:nul]
                break
            out += chunk
        return out.decode("utf-8", "replace")

    # -- conventions -------------------------------------------------------------
    def arg(self, n: int | str) -> int:
        """The n-th (1-based) integer argument at function entry, by the architecture's calling convention.

        ``n`` may also be the parameter's name in the C source (``regs.arg("count")``),
        looked up in the debug info of the function containing ``ip``.
        """
        if isinstance(n, str):
            n = self._param_index(n)
        if n < 1:
            raise ValueError("arguments are numbered from 1")
        args = self._layout.arg_regs
        if n <= len(args):
            return self._values[args[n - 1]]
        return self.read_u64(self.sp + self._layout.stack_args + 8 * (n - len(args) - 1))

    def _param_index(self, name: str) -> int:
        if self._symbols is None or self._kernel is None:
            raise ValueError("argument names need the kernel's symbols")
        fn = self._symbols.function(self.ip)
        if fn is None:
            raise ValueError(f"{self.ip:#x} is not in a known function")
        params = self._kernel.params(fn.name, fn.addr)
        if name not in params:
            raise ValueError(f"{fn.name} has no parameter {name!r} (it has {', '.join(params) or 'none'})")
        return params.index(name) + 1

    def return_value(self) -> int:
        """The register a function returns its value in, by the architecture's calling convention."""
        return self._values[self._layout.retval]

    def stack(self, n: int = 0) -> int:
        """``$stackN``: the n-th u64 on the stack."""
        return self.read_u64(self.sp + 8 * n)

    def symbolize(self, addr: int | None = None) -> str:
        addr = self.ip if addr is None else addr
        return self._symbols.symbolize(addr) if self._symbols else f"{addr:#x}"

    def stack_trace(self, max_frames: int = 64) -> Stack:
        """This hit's kernel stack, innermost first: drgn's frames, inlined calls and file:line included.

        drgn unwinds from these registers with vmlinux's ORC and DWARF; a
        kretprobe trampoline shows as the real return address.  ``print()`` it,
        or look at each frame's ``name``, ``pc`` and ``source()``.
        """
        if self._kernel is None:
            raise SymbolError("no vmlinux debug info for this hit: cannot unwind its stack")
        return self._kernel.stack_trace(self._values, self.fix_return, max_frames)

    def __repr__(self) -> str:
        body = " ".join(f"{k}={v:#x}" for k, v in self._values.items())
        return f"<pt_regs vcpu={self.vcpu} {body}>"


def regs_return_value(regs: PtRegs) -> int:
    """The function's return value at a return probe (x86's ``ax``), as the kernel's helper."""
    return regs.return_value()


def regs_get_kernel_argument(regs: PtRegs, n: int) -> int:
    """0-based argument, as the kernel's helper of that name."""
    return regs.arg(n + 1)


class RegsSource(Protocol):
    """Where a hit's pt_regs come from (qprobe.core.regsmaker.RegsMaker): vCPU ``tid``'s register values."""

    def make_regs(self, values: Mapping[str, int], tid: str) -> PtRegs: ...
