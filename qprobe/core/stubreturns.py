"""Return probes on the gdbstub's own breakpoints: nothing is written into the guest.

A kretprobe replaces the return address on the stack with a trampoline's; that
is a write into the guest, which the places only stub breakpoints reach (the
kernel's blacklist, boot before int3 works, user space) must not get.  Here
the return is caught where it lands instead: at the entry hit the caller hands
over the registers, the return address and the stack pointer the return will
have are read (``Arch.arch_prepare_kretprobe``), and a stub breakpoint goes on the
return address (one per address, kept while some instance needs it).  Every
vCPU that reaches that address stops there, so a return hit is matched to its
call by a caller-given identity (``key(regs)``: the current task in the kernel,
the address space and task in user space) and the stack pointer; others step
on.  When a call's return is matched, the same key's instances taken after it
deeper in the stack are dropped: their frames were abandoned (a longjmp, an exception unwound past
them), as the kernel's rethook drops the instances above the one returning.

Use::

    returns = StubReturns(stubs, arch)               # stubs: StubProbes, or any StubSites
    rp = StubReturn(key=lambda regs: ..., ret_handler=on_return, maxactive=16)
    returns.register(rp)
    # in the entry probe's pre_handler (the vCPU on the function's first instruction):
    inst = returns.entered(rp, regs, data)           # None: maxactive instances live (rp.nmissed counts it)
    # when that call returns: on_return(inst, regs), regs at the return address, the return value in them
    returns.unregister(rp)                           # its live instances dropped, their breakpoints out

``ret_handler`` runs on the stop loop inside the return site's pre_handler: an
exception it raises is counted on that internal probe, so callers wrap user code
(``Handlers.call``) to count it on their own probe.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol

from qprobe.arch import Arch
from qprobe.core.anywhere import InternalProbe
from qprobe.core.kprobe import Kprobe
from qprobe.core.regs import PtRegs
from qprobe.errors import QprobeError


class StubSites(Protocol):
    """Where stub breakpoints come from (qprobe.core.anywhere.StubProbes): one probe list per address."""

    def register(self, kp: Kprobe, addr: int, where: str) -> None: ...
    def unregister(self, kp: Kprobe) -> None: ...


@dataclass(eq=False)
class StubReturnInstance:
    """One call in flight: where it returns, with which stack pointer, for which key."""

    owner: StubReturn
    key: Hashable
    ret_addr: int
    sp: int  # the stack pointer at the return address once the function returned
    data: Any = None  # the caller's (a kretprobe's KretprobeInstance)


class StubReturn:
    """One return probe's part: ``key(regs)`` names whose call it is, ``ret_handler(inst, regs)`` its return.

    ``maxactive`` bounds the calls in flight (the kernel's kretprobe ``maxactive``); an entry past
    it counts in ``nmissed``.  ``nreturns`` counts the returns matched.
    """

    def __init__(self, key: Callable[[PtRegs], Hashable],
                 ret_handler: Callable[[StubReturnInstance, PtRegs], None], maxactive: int) -> None:  # fmt: skip
        if maxactive < 1:
            raise ValueError("maxactive must be at least 1")
        self.key = key
        self.ret_handler = ret_handler
        self.maxactive = maxactive
        self.live: list[StubReturnInstance] = []
        self.nmissed = 0
        self.nreturns = 0
        self.registered = False


class ReturnSite(InternalProbe):
    """The internal probe on a return address."""

    def __init__(self, addr: int, pre_handler: Callable[[Kprobe, PtRegs], int]) -> None:
        super().__init__(addr=addr, anywhere=True, pre_handler=pre_handler)
        self.resolved = self.at = addr  # armed where given: no symbol to resolve, no __fentry__ to step past
        self.instances: list[StubReturnInstance] = []  # the calls in flight that return here


class StubReturns:
    """Return probes of any number of owners, sharing return sites, matched by key and stack pointer."""

    def __init__(self, stubs: StubSites, arch: Arch) -> None:
        self.stubs = stubs
        self.arch = arch
        self.sites: dict[int, ReturnSite] = {}
        self.by_key: dict[Hashable, list[StubReturnInstance]] = {}  # in the order the calls were entered

    def register(self, rp: StubReturn) -> None:
        rp.registered = True

    def unregister(self, rp: StubReturn) -> None:
        """Drop ``rp``'s calls in flight (their returns go unreported, as an unregistered kretprobe's)."""
        for inst in list(rp.live):
            self.discard(inst)
        rp.registered = False

    def entered(self, rp: StubReturn, regs: PtRegs, data: Any = None) -> StubReturnInstance | None:
        """At the entry of a call (the vCPU on the function's first instruction): its instance, or None."""
        if not rp.registered:
            return None
        if len(rp.live) >= rp.maxactive:
            rp.nmissed += 1
            return None
        ret_addr, sp = self.arch.arch_prepare_kretprobe(regs, regs.read_u64).ret_addr, regs.sp + self.arch.ret_pops
        inst = StubReturnInstance(rp, rp.key(regs), ret_addr, sp, data)
        site = self.sites.get(ret_addr)
        if site is None:
            site = ReturnSite(ret_addr, self._returned)
            try:
                self.stubs.register(site, ret_addr, f"return site {ret_addr:#x}")
            except QprobeError:  # no breakpoint there (the stub's limit under KVM): this call goes unprobed
                rp.nmissed += 1
                return None
            self.sites[ret_addr] = site
        site.instances.append(inst)
        rp.live.append(inst)
        self.by_key.setdefault(inst.key, []).append(inst)
        return inst

    def discard(self, inst: StubReturnInstance) -> None:
        """Forget a call in flight (an entry handler declined it, its frame was abandoned)."""
        if inst not in inst.owner.live:
            return
        inst.owner.live.remove(inst)
        same = self.by_key[inst.key]
        same.remove(inst)
        if not same:
            del self.by_key[inst.key]
        site = self.sites[inst.ret_addr]
        site.instances.remove(inst)
        if not site.instances:
            del self.sites[inst.ret_addr]
            self.stubs.unregister(site)

    def retire(self, gone: Callable[[int], bool]) -> None:
        """Forget the calls in flight that would return to addresses ``gone`` says are no longer text."""
        for site in [site for addr, site in self.sites.items() if gone(addr)]:
            for inst in list(site.instances):
                self.discard(inst)

    def _returned(self, _kp: Kprobe, regs: PtRegs) -> int:
        """A vCPU on a return site: run the calls of its key returning here with its stack pointer."""
        site = self.sites.get(regs.ip)
        if site is None:
            return 0
        keys: dict[Callable[[PtRegs], Hashable], Hashable] = {}  # each owner's key, computed once a hit
        for inst in [i for i in site.instances if i.sp == regs.sp]:
            fn = inst.owner.key
            if fn not in keys:
                keys[fn] = fn(regs)
            if keys[fn] != inst.key or inst not in inst.owner.live:
                continue
            # The same key's calls entered after this one, deeper in its stack, never returned: their
            # frames are gone (a longjmp, an exception unwound past them).
            same = self.by_key[inst.key]
            for later in same[same.index(inst) + 1 :]:
                if later.sp < inst.sp:
                    self.discard(later)
            self.discard(inst)
            inst.owner.nreturns += 1
            inst.owner.ret_handler(inst, regs)
        return 0


__all__ = ["ReturnSite", "StubReturn", "StubReturnInstance", "StubReturns", "StubSites"]
