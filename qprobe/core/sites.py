"""Where a probe goes, and where it may not: the kernel's _kprobe_addr and check_kprobe_address_safe."""

from __future__ import annotations

import functools
from collections.abc import Collection

import drgn

from qprobe.arch import Arch
from qprobe.core.blacklist import Blacklist
from qprobe.core.kprobe import Kprobe
from qprobe.core.text import KernelText
from qprobe.errors import Blacklisted, InvalidProbe, NotKernelText, QprobeError, SymbolError
from qprobe.kernel.program import KernelData
from qprobe.kernel.reserved import ReservedText
from qprobe.kernel.tracefs import ftrace_record_ips
from qprobe.vmm.machine import Machine


class ProbeSites:
    """Resolves a probe's address and checks it (no guest writes)."""

    def __init__(self, machine: Machine, kernel: KernelData, arch: Arch, text: KernelText) -> None:
        self.machine = machine
        self.kernel = kernel
        self.arch = arch
        self.text = text
        self.symbols = symbols = kernel.symbols
        self.blacklist = Blacklist(symbols, arch.arch_populate_kprobe_blacklist())
        self._ftrace_records: tuple[int, frozenset[int]] | None = None  # (modules loaded, their ips)
        site = arch.ftrace_site  # its entry is in the kernel with CONFIG_FUNCTION_TRACER
        self._ftrace = (site, symbols.address(site.entry)) if site is not None and site.entry in symbols else None

    def kprobe_addr(self, kp: Kprobe) -> int:
        """``_kprobe_addr``: the address the kernel's kprobe would have (its ``kp->addr``).

        ``sym+offset`` or ``addr+offset``, moved past an ``endbr64`` at a function's
        entry as ``arch_adjust_kprobe_addr`` does on IBT kernels (an indirect call
        must land on the ENDBR, so it stays in place).
        """
        if kp.symbol_name is not None:
            try:
                addr = self.symbols.address(kp.symbol_name) + kp.offset
            except SymbolError:
                raise SymbolError(f"unknown symbol {kp.symbol_name!r}: not in the kernel's symbol table") from None
        else:
            assert kp.addr is not None
            addr = kp.addr + kp.offset
        fn = self.symbols.function(addr)
        if fn is not None:
            addr = self.arch.arch_adjust_kprobe_addr(self.text.original(fn.addr, 4), fn.addr, addr - fn.addr)
        return addr

    def entry_skip(self, fn_addr: int) -> int:
        """Bytes at a function's start that are not its entry for probes (an ENDBR on x86)."""
        return self.arch.entry_skip(self.text.original(fn_addr, 4))

    def ftrace_site(self, addr: int) -> int:
        """The size of the ftrace call site at ``addr`` (x86's ``call __fentry__``), 0 where there is none.

        Those bytes belong to the guest's ftrace: boot turns each into a NOP,
        and its function tracer or its own kprobe_events on a function entry
        (ftrace-based on x86) turn it back into a call, after checking that the
        bytes are what ftrace left there (``ftrace_verify_code``; anything else
        is an ``ftrace_bug`` that disables the guest's ftrace).  So qprobe never
        writes there: a probe on such a site is armed on the next instruction,
        where the registers are the same (a NOP ran in between), as the
        kernel's own probes there run from ftrace with ``[FTRACE]`` in its list.
        """
        if self._ftrace is None or not self.symbols.ftrace_site(addr, *self._ftrace):
            return 0
        return self._ftrace[0].size

    def check_kprobe_address_safe(self, addr: int, anywhere: bool = False) -> tuple[str, int, bytes]:
        """(sym+off text, function start, function bytes) or a ProbeError saying why not.

        ``anywhere`` (a stub breakpoint, which writes nothing) lets the blacklist and the sites the
        kernel rewrites be probed, and an assembler label of entry text (entry_SYSCALL_64) stand for a
        function: not a sized function symbol, it reaches as kallsyms' symbols do, to the next symbol.
        """
        where = self.symbols.symbolize(addr)
        if not self.symbols.is_text(addr):
            raise NotKernelText(f"{where} ({addr:#x}) is not in kernel text")
        if not anywhere:
            bad = self.blacklist.lookup(addr)
            if bad is not None:
                raise Blacklisted(f"{where} is blacklisted ({bad.name}): probing it would break the trap path "
                                  "(Kprobe(anywhere=True) probes it with a stub breakpoint)")  # fmt: skip
            reserved = self.reserved.conflict(addr, addr)
            if reserved is not None:
                raise InvalidProbe(f"{where} is reserved ({reserved}): the kernel rewrites it at run time (EINVAL)")
            if addr in self._ftrace_calls(addr):
                raise InvalidProbe(f"{where} is ftrace's call site: the guest's ftrace rewrites it, and kprobes on "
                                   "this architecture do not run from ftrace (EINVAL)")  # fmt: skip
        fn = self.symbols.containing(addr) if anywhere else self.symbols.function(addr)
        if fn is None:
            raise NotKernelText(f"{addr:#x} is not inside a known kernel {'symbol' if anywhere else 'function'}")
        code = self.machine.mem.read(fn.addr, fn.size or self.symbols.kallsyms_size(fn))
        return where, fn.addr, code

    def _ftrace_calls(self, addr: int) -> Collection[int]:
        """The instructions the guest's ftrace patches, where the architecture has no ftrace call as linked
        (``Arch.ftrace_site`` None): check_ftrace_location refuses a kprobe on one (EINVAL).  Read from the
        running kernel again after a module load (a module's records join the list then)."""
        if self.arch.ftrace_site is not None:
            return ()
        loaded = len(self.symbols.modules)
        if self._ftrace_records is None or self._ftrace_records[0] != loaded:
            try:
                self._ftrace_records = (loaded, ftrace_record_ips(self.kernel.prog))
            except (QprobeError, drgn.FaultError):
                self._ftrace_records = (loaded, frozenset())  # no debug info: the kernel's types say nothing
        return self._ftrace_records[1]

    @functools.cached_property
    def reserved(self) -> ReservedText:
        """Jump-label, static-call and BUG sites (check_kprobe_address_safe refuses them)."""
        try:
            bug_entry = self.kernel.prog.type("struct bug_entry").size
        except (QprobeError, LookupError):
            bug_entry = None  # no debug info: BUG sites are not known
        return ReservedText(self.symbols, lambda a, n: self.machine.mem.read(a, n), bug_entry, self.arch)

    def arming_address(self, kp: Kprobe) -> int:
        """Where a probe is armed: past an ftrace call site, which is the guest's ftrace's (not for a stub
        breakpoint, which writes nothing there)."""
        return kp.at if kp.anywhere else kp.at + self.ftrace_site(kp.at)
