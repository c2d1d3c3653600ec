"""Probes on module functions: the guest's module notifier, kept on the host.

The kernel does three things when a module comes and goes, and qprobe does
the same from three probes of its own, on the functions that run at those
moments (found in vmlinux; a kernel without one cannot track modules):

- ``do_init_module`` runs once a module is in place and in state COMING,
  before its init function: ``trace_kprobe_module_callback`` registers the
  events that name ``MOD:SYM`` of that module there (defined while it was
  not loaded, or killed by an earlier unload), and logs "Failed to
  re-register probe" for those it cannot;
- ``module_arch_freeing_init`` runs once a module is LIVE, before its init
  text is queued to be freed (``do_free_init``, after an RCU grace period):
  ``kprobes_module_callback`` kills the probes in its init text at LIVE
  (``[GONE]``, counts kept; the init function has returned by then), and
  qprobe puts their original bytes back; from then on the module's init
  symbols are gone from its kallsyms, and probes there are refused;
- ``free_module`` runs before a module's memory is freed, after it
  unloaded or failed to init: ``kprobes_module_callback`` kills every probe
  in its text (``[GONE]`` in the kprobes list; counts kept).  qprobe puts
  the original bytes back first, so nothing it wrote outlives the module's
  memory.

Modules already loaded are read when the first module probe is asked for.
Their symbols, text, ftrace sites and reserved sites come from the guest's
``struct module`` through drgn (qprobe.kernel.modules).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import drgn

from qprobe.core.anywhere import InternalProbe, StubPoint
from qprobe.core.kprobe import Kprobe, Kretprobe
from qprobe.core.regs import PtRegs
from qprobe.errors import QprobeError, SymbolError
from qprobe.kernel.modules import MODULE_STATE_LIVE, loaded_modules, module_state, read_module

if TYPE_CHECKING:
    from collections.abc import Callable

    from qprobe.core.kprobes import KprobeManager
    from qprobe.core.kretprobe import KretprobeManager
    from qprobe.core.point import ProbePoint
    from qprobe.events.define import EventRegistry
    from qprobe.events.event import TraceEvent
    from qprobe.kernel.program import KernelData
    from qprobe.kernel.symbols import ModuleText
    from qprobe.vmm.machine import Machine

    class NotifierTarget(EventRegistry, Protocol):
        """What the notifier uses of a target (qprobe.eventapi.EventAPI): the events' view, the stop loop, the
        kernel's modules (drgn) and the probe tables (a going module's probes are killed, events or not)."""

        machine: Machine
        kernel: KernelData
        kprobes: KprobeManager
        kretprobes: KretprobeManager


log = logging.getLogger("qprobe.modules")

COMING_HOOK = "do_init_module"  # static noinline int do_init_module(struct module *mod), Linux 3.7 on
GOING_HOOK = "free_module"  # static void free_module(struct module *mod)
# void __weak module_arch_freeing_init(struct module *mod), Linux 3.19 on (d453cded05ee): called where a module's
# init memory is about to be freed: in do_init_module once it is LIVE, and on the ways a module goes.
INIT_FREEING_HOOK = "module_arch_freeing_init"


class ModuleNotifier:
    """Loaded modules' symbols in ``target.symbols``, kept current by two host-side probes."""

    def __init__(self, target: NotifierTarget) -> None:
        self.target = target
        self.hooks: list[Kprobe] = []
        self.loads = 0
        self.unloads = 0

    @property
    def started(self) -> bool:
        """Following the modules: every hook armed (removing every probe removes them too)."""
        return bool(self.hooks) and all(kp.registered for kp in self.hooks)

    def start(self) -> None:
        """Read the loaded modules and hook module load and unload (once); SymbolError if it cannot."""
        if self.started:
            return
        self.stop()
        symbols = self.target.symbols
        missing = [fn for fn in (COMING_HOOK, GOING_HOOK, INIT_FREEING_HOOK) if fn not in symbols]
        if missing:
            raise SymbolError(f"this kernel has no {' or '.join(missing)}: qprobe cannot follow its modules")
        try:
            prog = self.target.kernel.prog
        except SymbolError as exc:
            raise SymbolError(f"probes on modules need the kernel's debug info: {exc}") from None
        # Hooked while the kernel boots (before it frees __init; modules come from the initramfs): stub
        # breakpoints, and they stay so, not moved to the int3 path with the boot's other probes, where the
        # move queues them for a jump: their handlers register and unregister probes, which needs a stop.
        anywhere = symbols.init_text
        hooks = [Kprobe(symbol_name=COMING_HOOK, pre_handler=self._coming, anywhere=anywhere),
                 Kprobe(symbol_name=GOING_HOOK, pre_handler=self._going, anywhere=anywhere),
                 Kprobe(symbol_name=INIT_FREEING_HOOK, pre_handler=self._init_freeing, anywhere=anywhere)]  # fmt: skip

        def install() -> None:  # one stop: no module can come or go between the read and the hooks
            for mod in loaded_modules(prog):
                symbols.add_module(mod)
            for kp in hooks:
                # Stop-based: the handlers register and unregister probes, which needs the VM stopped.
                self.target.kprobes.register_kprobe(kp, optimize=False)
                self.hooks.append(kp)

        self.target.machine.call(install)

    def loaded(self) -> list[ModuleText]:
        """The guest's loaded modules now: as followed, or read from guest memory in one VM stop.

        Empty for a kernel qprobe cannot read modules of (no debug info, no modules).
        """
        if self.started:
            return list(self.target.symbols.modules.values())
        try:
            prog = self.target.kernel.prog
            return self.target.machine.call(lambda: loaded_modules(prog))
        except (QprobeError, LookupError, drgn.FaultError) as exc:
            log.debug("modules not read: %s", exc)
            return []

    def stop(self) -> None:
        """Stop following: unhook, and forget the modules (what is loaded may change from now on)."""
        for kp in self.hooks:
            if kp.registered:
                self.target.kprobes.unregister_kprobe(kp)
        self.hooks.clear()
        self.target.symbols.modules.clear()

    # -- the three moments (stop-loop thread, every vCPU stopped) -------------------------------
    def _module(self, regs: PtRegs) -> drgn.Object:
        return drgn.Object(self.target.kernel.prog, "struct module *", value=regs.arg(1))

    def _coming(self, _kp: Kprobe, regs: PtRegs) -> int:
        mod = read_module(self._module(regs))
        self.target.symbols.add_module(mod)
        self.loads += 1
        for te in self._events_of(mod.name):
            try:
                self._reregister(te)
            except QprobeError as exc:
                te.errors.append(f"Failed to re-register probe {te.definition.event} on {mod.name}: {exc}")
                log.warning("Failed to re-register probe %s on %s: %s", te.definition.event, mod.name, exc)
        return 0

    def _going(self, _kp: Kprobe, regs: PtRegs) -> int:
        name = self._module(regs).name.string_().decode()
        symbols = self.target.symbols
        mod = symbols.modules.get(name)
        if mod is None:
            return 0
        self.unloads += 1
        self._kill(mod.is_text)
        symbols.remove_module(name)
        return 0

    def _init_freeing(self, kp: Kprobe, regs: PtRegs) -> int:
        module = self._module(regs)
        if module_state(module) != MODULE_STATE_LIVE:
            # A module going (free_module, or load_module undoing a load): all of its memory goes.
            return self._going(kp, regs)
        mod = self.target.symbols.modules.get(module.name.string_().decode())
        if mod is None or not mod.init_text:
            return 0
        self._kill(mod.is_init_text)
        self.target.symbols.add_module(read_module(module))  # LIVE: without init text and init symbols
        return 0

    def _kill(self, where: Callable[[int], bool]) -> None:
        """``kill_kprobe`` for every probe in the text about to be freed, its original bytes back first."""
        kprobes = self.target.kprobes
        points: list[ProbePoint | StubPoint] = [*kprobes.points.values(), *kprobes.stubs.points.values()]
        for kp in [kp for p in points if where(p.addr) for kp in p.probes if not isinstance(kp, InternalProbe)]:
            rp = kp.kretprobe
            if isinstance(rp, Kretprobe):
                self.target.kretprobes.kill_kretprobe(rp)
            else:
                kprobes.kill_kprobe(kp)

    def _events_of(self, module: str) -> list[TraceEvent]:
        """``trace_kprobe_within_module``: events whose symbol is ``MODULE:...``, each appended probe too."""
        return [one for te in self.target.events.values() for one in te.probes()
                if one.definition.symbol is not None and one.definition.symbol.startswith(module + ":")]  # fmt: skip

    def _reregister(self, te: TraceEvent) -> None:
        """``__register_trace_kprobe`` again for an event of a module that just came."""
        from qprobe.events.define import check_notrace, register_probe
        from qprobe.events.kprobe import KprobeEvent

        assert isinstance(te, KprobeEvent), "only kprobe events name a module's symbol"
        probe = te.probe
        if probe is None:
            te.anywhere = check_notrace(self.target, te.definition, te.anywhere)
            try:
                register_probe(te)
            except QprobeError:
                te.probe = None  # still pending: the next load tries again
                raise
            return
        kp = probe.kp if isinstance(probe, Kretprobe) else probe
        if kp.registered:
            return
        # Killed on an unload: __unregister_trace_kprobe, then register; listed [GONE] still if that fails.
        with self.target.kprobes.reviving(kp):
            if check_notrace(self.target, te.definition, te.anywhere):
                te.anywhere = kp.anywhere = True  # a notrace function's, while booting: a stub for good
            te.backend.register_probe(probe)
