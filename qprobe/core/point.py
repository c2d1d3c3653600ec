"""The engine's data: one probed address, its optimized form, and a vCPU's kprobe state.

Plain data at the bottom of the core, imported by every part that works on
them (registry, dispatcher, optimizer) and importing none of them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from qprobe.arch import Prepared
from qprobe.core.kprobe import Kprobe
from qprobe.vmm.journal import Patch


class KprobeStatus(enum.Enum):
    """kprobe_ctlblk.kprobe_status: whether this vCPU is inside a probe's handling (a hit now only counts)."""

    IDLE = 0
    HIT_ACTIVE = 1
    HIT_SS = 2  # running a probe's copy out of line; the trap after it finishes the hit


@dataclass
class KprobeCtlblk:
    """Per-vCPU state (the kernel's per-CPU kprobe_ctlblk); ``point`` and ``active`` while HIT_SS."""

    status: KprobeStatus = KprobeStatus.IDLE
    point: ProbePoint | None = None  # the kernel's current_kprobe
    active: list[Kprobe] = field(default_factory=list)  # the probes whose post_handlers run at the second trap


@dataclass
class Optimized:
    """What an optimized probe point owns besides its int3-less text."""

    probe_id: int
    detour: int
    size: int  # bytes of text the jmp displaces (whole instructions)
    jmp: Patch
    continue_addr: int
    kind: str = "mailbox"  # see qprobe.core.optimizer.detour_kind
    tables: int = 0  # "keyed": CPU 0's table of keyed counts
    fence: int | None = None  # its entry in the guest's kprobe_blacklist (qprobe.core.fence)


@dataclass
class ProbePoint:
    """All probes at one address: one int3, one slot (the kernel's aggregate kprobe)."""

    addr: int
    where: str
    prep: Prepared
    probes: list[Kprobe] = field(default_factory=list)
    int3: Patch | None = None
    boosted: int = 0  # hits that ran the copy freely with a jmp back instead of a single-step
    trap_stepped: int = 0  # hits whose copy ran out of line to the int3 after it
    opt: Optimized | None = None  # set while jump-optimized
    opt_size: int = 0
    not_optimized: str | None = None  # why the last attempt to optimize it failed
    optimizing: bool = False  # queued for the optimizer: hits are single-stepped, not boosted

    @property
    def armed(self) -> bool:
        return self.int3 is not None or self.opt is not None

    def wants_arming(self) -> bool:
        return any(not kp.disabled for kp in self.probes)

    def active(self) -> list[Kprobe]:
        """The probes whose handlers run at a hit."""
        return [kp for kp in self.probes if not kp.disabled]


__all__ = ["KprobeCtlblk", "KprobeStatus", "Optimized", "ProbePoint"]
