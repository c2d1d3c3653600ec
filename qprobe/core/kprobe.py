"""The user-facing probe objects, named as in <linux/kprobes.h>."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from qprobe.errors import InvalidProbe

if TYPE_CHECKING:
    from qprobe.core.kretprobe import Kretprobe
    from qprobe.core.optimizer import GuestRecord

PreHandler = Callable[["Kprobe", Any], int | None]
PostHandler = Callable[["Kprobe", Any], None]
FaultHandler = Callable[["Kprobe", Any, BaseException], int | None]

KPROBE_FLAG_GONE = 1
KPROBE_FLAG_DISABLED = 2
KPROBE_FLAG_OPTIMIZED = 4


class Kprobe:
    """A probe on one kernel instruction.

    Give ``symbol_name`` (with an optional ``offset``) or ``addr``, not both
    (the kernel answers EINVAL).  Handlers run on the host with ``(kp, regs)``;
    a ``pre_handler`` that returns non-zero after changing ``regs.ip`` skips
    the probed instruction, as in the kernel.  ``fault_handler(kp, regs, exc)``
    hears about a fault in the out-of-line step or an exception in a handler.
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
    ) -> None:
        if symbol_name is not None and addr is not None:
            raise InvalidProbe("give symbol_name or addr, not both (EINVAL)")
        if symbol_name is None and addr is None:
            raise InvalidProbe("a kprobe needs a symbol_name or an addr (EINVAL)")
        if not isinstance(offset, int) or offset < 0:
            raise InvalidProbe(f"offset must be a non-negative int, not {offset!r} (EINVAL)")
        for name, fn in (("pre_handler", pre_handler), ("post_handler", post_handler),
                         ("fault_handler", fault_handler)):  # fmt: skip
            if fn is not None and not callable(fn):
                raise InvalidProbe(f"{name} must be callable, not {type(fn).__name__} (EINVAL)")
        self.symbol_name = symbol_name
        self.offset = offset
        self.addr = addr
        self.pre_handler = pre_handler
        self.post_handler = post_handler
        self.fault_handler = fault_handler
        self.flags = KPROBE_FLAG_DISABLED if disabled else 0
        self.nhit = 0
        self.nmissed = 0
        self.nfaults = 0
        self.nlost = 0  # hits whose in-guest record was dropped on a full ring (also in nmissed)
        # An action that can run in the guest instead of pre_handler once the probe is jump-optimized:
        # the detour records the registers into a per-CPU ring and this gets them (see
        # qprobe.core.optimizer.detour_kind).  Set by kprobe_events definitions; pre_handler still runs
        # on the int3 path, and must compute the same thing.
        self.recorder: Callable[[GuestRecord], None] | None = None
        # With a recorder: a filter the detour runs first (qprobe.arch.x86_64.guestfilter's tree); the hits
        # it rejects are counted in nhit and nfiltered and never recorded.
        self.guest_filter: object | None = None
        self.nfiltered = 0
        # Instead of records: count hits by a key the detour computes from a register (the arch layer's
        # KeySpec), in per-CPU tables in guest RAM that the front end reads (the shell's count/hist).
        self.guest_key: object | None = None
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
