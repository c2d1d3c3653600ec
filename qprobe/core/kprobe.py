"""The user-facing probe objects, named as in <linux/kprobes.h>: struct kprobe, struct kretprobe and its instances.

Plain data at the bottom of the core: the managers that register them import
this module, never the reverse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qprobe.errors import InvalidProbe

if TYPE_CHECKING:
    from qprobe.arch.guestram import Pool
    from qprobe.arch.inguest import GuestFilter, KeySpec
    from qprobe.core.regs import PtRegs
    from qprobe.kernel.program import Task
    from qprobe.vmm.journal import Patch

PreHandler = Callable[["Kprobe", Any], int | None]
PostHandler = Callable[["Kprobe", Any], None]
FaultHandler = Callable[["Kprobe", Any, BaseException], int | None]

KPROBE_FLAG_GONE = 1
KPROBE_FLAG_DISABLED = 2
KPROBE_FLAG_OPTIMIZED = 4


def check_handlers(**handlers: object) -> None:
    """Refuse a probe given a handler (by its parameter's name) that is neither None nor callable."""
    for name, fn in handlers.items():
        if fn is not None and not callable(fn):
            raise InvalidProbe(f"{name} must be callable, not {type(fn).__name__} (EINVAL)")


class Kprobe:
    """A probe on one kernel instruction.

    Give ``symbol_name`` (with an optional ``offset``) or ``addr``, not both
    (the kernel answers EINVAL).  Handlers run on the host with ``(kp, regs)``;
    a ``pre_handler`` that returns non-zero after changing ``regs.ip`` skips
    the probed instruction, as in the kernel.  ``fault_handler(kp, regs, exc)``
    hears about a fault in the out-of-line step or an exception in a handler.
    ``anywhere`` arms it with a breakpoint of QEMU's gdbstub instead of an int3
    in the text, which also reaches what the kernel's kprobes refuse (its
    blacklist, entry text, text it rewrites at run time), at one or two VM stops a hit.
    """

    def __init__(
        self,
        symbol_name: str | None = None,
        offset: int = 0,
        addr: int | None = None,
        pre_handler: PreHandler | None = None,
        post_handler: PostHandler | None = None,
        fault_handler: FaultHandler | None = None,
        disabled: bool = False,
        anywhere: bool = False,
    ) -> None:
        if symbol_name is not None and addr is not None:
            raise InvalidProbe("give symbol_name or addr, not both (EINVAL)")
        if symbol_name is None and addr is None:
            raise InvalidProbe("a kprobe needs a symbol_name or an addr (EINVAL)")
        if not isinstance(offset, int) or offset < 0:
            raise InvalidProbe(f"offset must be a non-negative int, not {offset!r} (EINVAL)")
        check_handlers(pre_handler=pre_handler, post_handler=post_handler, fault_handler=fault_handler)
        self.symbol_name = symbol_name
        self.offset = offset
        self.addr = addr
        self.pre_handler = pre_handler
        self.post_handler = post_handler
        self.fault_handler = fault_handler
        self.flags = KPROBE_FLAG_DISABLED if disabled else 0
        # Armed with a gdbstub breakpoint instead of an int3 (qprobe.core.anywhere): nothing written into
        # the guest, so the kernel's blacklist and run-time-patched sites can be probed too.
        self.anywhere = anywhere
        # On a stub breakpoint only because it was armed before the kernel could take an int3 (a boot-time
        # probe not asked anywhere): KprobeManager.switch_from_boot moves it to the int3 path once boot is done.
        self.boot_stub = False
        self.nhit = 0
        self.nmissed = 0
        self.nfaults = 0
        self.nlost = 0  # hits whose in-guest record was dropped on a full ring (also in nmissed)
        # An action that can run in the guest instead of pre_handler once the probe is jump-optimized:
        # the detour records the registers into a per-CPU ring and this gets them, a run of records in
        # the guest's order at a time (see qprobe.core.optimizer.detour_kind).  Set by kprobe_events
        # definitions; pre_handler still runs on the int3 path, and must compute the same thing.
        self.recorder: Callable[[list[GuestRecord]], None] | None = None
        # With a recorder: a filter the detour runs first (register compares, qprobe.arch.inguest); the hits
        # it rejects are counted in nhit and nfiltered and never recorded.
        self.guest_filter: GuestFilter | None = None
        self.nfiltered = 0
        # Instead of records: fold hits into a map (a KeySpec: key and value the detour computes),
        # per-CPU tables in guest RAM that the front end reads (the shell's and trace's aggregations).
        self.guest_key: KeySpec | None = None
        self.kretprobe: Kretprobe | None = None  # the return probe whose entry this is
        self.errors: list[str] = []
        self.registered = False
        self.resolved = 0  # the running address qprobe armed, once registered
        # The address the kernel's own kprobe would have (kp->addr): ``resolved`` unless that is an
        # __fentry__ site, which qprobe leaves to the guest's ftrace and probes on the next instruction.
        self.at = 0

    @property
    def disabled(self) -> bool:
        return bool(self.flags & KPROBE_FLAG_DISABLED)

    @property
    def gone(self) -> bool:
        return bool(self.flags & KPROBE_FLAG_GONE)

    def where(self) -> str:
        if self.symbol_name is not None:
            return f"{self.symbol_name}+{self.offset:#x}"
        return f"{self.addr:#x}" if self.addr is not None else "?"

    def __repr__(self) -> str:
        return f"<Kprobe {self.where()} nhit={self.nhit} nmissed={self.nmissed}>"


@dataclass(slots=True)
class GuestRecord:
    """One hit recorded in the guest (by a detour, or a uprobe handler), as the host drained it from a ring."""

    # registers at the probe by the gdbstub's names (RegisterLayout.gdb_name's values), and ``cycles``
    values: dict[str, int]
    cpu: int
    pid: int
    comm: str
    task: int  # the task_struct address
    time: float  # host monotonic clock, from the record's cycle counter value
    func: int = 0  # a uprobe return's probed function (the ring's func; 0 for every other record)


Handler = Callable[["KretprobeInstance", "PtRegs"], Any]


@dataclass
class KretprobeInstance:
    """One live call of a return-probed function (``struct kretprobe_instance``)."""

    rp: Kretprobe
    ret_addr: int = 0
    stack_slot: int = 0  # where the return address lives on the guest stack (0: in a register)
    task: Task | None = None
    data: bytearray = field(default_factory=bytearray)
    patch: Patch | None = None
    frame: int = 0  # the stack pointer at the call's entry: which call a return ends (the kernel's ri->fp)


class Kretprobe:
    """A return probe, as ``struct kretprobe``.

    ``handler(ri, regs)`` runs when the function returns (``regs_return_value(regs)``
    is its return value; a handler may change ``regs.ax`` to inject a fault);
    ``entry_handler(ri, regs)`` runs at entry and, by returning non-zero,
    leaves that call unprobed.  ``maxactive`` bounds live instances (0: the
    kernel's default); a call with none free counts in ``nmissed``.
    ``ri.data`` is ``data_size`` bytes shared between the two handlers.
    ``anywhere`` arms the entry and catches the return with stub breakpoints
    (qprobe.core.stubreturns): nothing written into the guest, not even the stack.
    """

    def __init__(self, symbol_name: str | None = None, handler: Handler | None = None,
                 entry_handler: Handler | None = None, maxactive: int = 0, data_size: int = 0,
                 addr: int | None = None, offset: int = 0, disabled: bool = False,
                 anywhere: bool = False) -> None:  # fmt: skip
        if maxactive < 0 or data_size < 0:
            raise InvalidProbe("maxactive and data_size must not be negative (EINVAL)")
        check_handlers(handler=handler, entry_handler=entry_handler)
        self.kp = Kprobe(symbol_name=symbol_name, addr=addr, offset=offset, disabled=disabled, anywhere=anywhere)
        self.kp.kretprobe = self
        self.handler = handler
        self.entry_handler = entry_handler
        self.maxactive = maxactive
        self.data_size = data_size
        self.nmissed = 0
        self.nreturns = 0  # calls that returned through a trampoline (handler run, or counted in the guest)
        self.nfaults = 0
        self.errors: list[str] = []
        self.pool: Pool | None = None  # its instances in guest RAM, when the optimizer has room for them
        self.free: list[KretprobeInstance] = []
        self.live: dict[int, KretprobeInstance] = {}  # frame (the entry's stack pointer) -> instance

    @property
    def nhit(self) -> int:
        return self.kp.nhit

    @property
    def registered(self) -> bool:
        return self.kp.registered

    def __repr__(self) -> str:
        return f"<Kretprobe {self.kp.where()} nhit={self.nhit} nmissed={self.nmissed} live={len(self.live)}>"
