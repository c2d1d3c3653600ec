"""The Python API: ``qprobe.boot()`` / ``qprobe.attach()`` give a ``Target``.

::

    import qprobe
    with qprobe.boot("debian-cloud", smp=2) as t:
        kp = qprobe.Kprobe(symbol_name="ksys_lseek", pre_handler=lambda kp, regs: print(regs.si))
        t.register_kprobe(kp)
        print(t.run("workload lseek 3").output)
        t.unregister_kprobe(kp)
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING

import drgn

from qprobe.arch import Arch, BootStage
from qprobe.arch.select import arch_named, arch_of_machine
from qprobe.core.anywhere import InternalProbe
from qprobe.core.kprobe import Kprobe
from qprobe.core.kprobes import KprobeManager
from qprobe.core.kretprobe import KretprobeManager
from qprobe.core.recovery import recover
from qprobe.core.regs import PtRegs
from qprobe.core.uprobes import UprobeManager
from qprobe.core.watchpoint import Watchpoints
from qprobe.errors import (
    BootPanic,
    GuestPanicked,
    GuestStalled,
    MemoryFault,
    QprobeError,
    SymbolError,
    TargetError,
    TargetGone,
    VmlinuxMismatch,
)
from qprobe.eventapi import EventAPI
from qprobe.events.clock import HitClock
from qprobe.events.kprobe import KprobeBackend
from qprobe.events.timeline import Timeline
from qprobe.events.uprobe import UprobeBackend
from qprobe.kernel.bootslide import BootSlide
from qprobe.kernel.features import fully_preemptible
from qprobe.kernel.kaslr import check_slide, detect_slide, image_alignment
from qprobe.kernel.program import KernelData, Stack, Task
from qprobe.kernel.stalled import vcpu_places
from qprobe.kernel.symbols import Symbols
from qprobe.kernel.vmlinux import elf_machine
from qprobe.paths import cache_dir, write_private
from qprobe.probeapi import ProbeAPI
from qprobe.vmm.bootfail import BootSetup
from qprobe.vmm.connection import Connection, parse_address
from qprobe.vmm.console import Console, GuestShell, RunResult, open_shell
from qprobe.vmm.gdbmi import GdbMiRemote
from qprobe.vmm.gdbremote import GdbRemote, drop_stale_breakpoints
from qprobe.vmm.journal import Journal, sweep_journals
from qprobe.vmm.machine import Machine
from qprobe.vmm.memory import GuestMemory, PhysReader, SharedRam
from qprobe.vmm.peer import listener_pid, process_identity
from qprobe.vmm.qemu import QemuProcess
from qprobe.vmm.scratch import ScratchArea, memmap_reservation
from qprobe.vmm.transport import GdbTransport

if TYPE_CHECKING:
    from qprobe.events import TraceEvent
    from qprobe.images import Image

log = logging.getLogger("qprobe")
SESSION_FILE = "session.json"
TRANSPORTS = ("rsp", "gdb")
# How often Target.wait looks whether the VM is still there.
LIVENESS_POLL = 0.2
# What init's exec runs through (fs/exec.c, since Linux 5.9's "exec: Implement kernel_execve"): a boot qprobe
# did not start, and has no shell of its own to wait for, is up once init runs.
INIT_EXEC = "kernel_execve"


def arch_of(gdb: GdbRemote | GdbMiRemote) -> Arch:
    """The target's architecture, by the name its gdbstub's target description gives it; its registers there."""
    if not gdb.architecture:
        raise TargetError("the gdbstub's target description names no architecture (<architecture>)")
    arch = arch_named(gdb.architecture)
    layout = arch.registers
    missing = sorted({*layout.gdb_name.values(), layout.page_table, layout.percpu_base} - set(gdb.regs))
    if missing:
        raise TargetError(f"the gdbstub describes no {', '.join(missing)}: not an {arch.name} system target")
    return arch


def vmlinux_arch(symbols: Symbols) -> Arch:
    """The architecture of the kernel ``symbols`` were read from, by its ELF machine."""
    return arch_of_machine(elf_machine(symbols.path))


def open_stub(transport: str, address: str, alive: Callable[[], bool] | None = None) -> GdbRemote | GdbMiRemote:
    """The gdbstub client: qprobe's own RSP client, or a real gdb driven through GDB/MI (same interface)."""
    if transport == "rsp":
        return GdbRemote(Connection.open(address, alive))
    if transport == "gdb":
        return GdbMiRemote(address, alive=alive)
    raise TargetError(f"unknown transport {transport!r}: expected one of {', '.join(TRANSPORTS)}")


class _StubPhys:
    """Physical reads through the stub, for a QEMU whose RAM we cannot map."""

    def __init__(self, gdb: GdbTransport) -> None:
        self.gdb = gdb
        self.machine: Machine | None = None

    def read_phys(self, paddr: int, size: int) -> bytes:
        def read() -> bytes:
            self.gdb.set_physical(True)
            try:
                return self.gdb.read_memory(paddr, size)
            except TargetError:
                raise MemoryFault(paddr, "outside guest RAM") from None

        return self.machine.call(read) if self.machine is not None else read()


@dataclass(frozen=True)
class BootPlan:
    """What a Target whose QEMU starts halted (-S) does before the kernel's first instruction."""

    arm: Callable[[Target], None]  # registers the boot-time probes (stub breakpoints: nothing else works yet)
    image: Path | None  # the kernel image QEMU boots: its KASLR alignment (None: not known)
    cmdline: str | None  # the kernel command line QEMU gives it (None: not known)
    unknown: str = ""  # why either is not known


class Target(ProbeAPI, EventAPI):
    """A running guest kernel under qprobe's control."""

    def __init__(self, gdb_address: str, vmlinux: str | Path, *, ram: Path | None = None, ram_size: int = 0,
                 console: Path | None = None, qemu: QemuProcess | None = None,
                 boot_timeout: float = 60.0, doorbell: Path | None = None, shell: Path | None = None,
                 system_map: Path | None = None, transport: str = "rsp",
                 boot: BootPlan | None = None) -> None:  # fmt: skip
        """``boot``: the QEMU was started halted (-S); probe the kernel from its first instructions on."""
        self.qemu = qemu
        self.image: Image | None = None  # set by boot(); None when attached to a foreign QEMU
        self.events: dict[str, TraceEvent] = {}
        self.timeline = Timeline()
        self.address = gdb_address
        self.timings: dict[str, float] = {}
        self.console: Console | None = None  # the kernel's console: its log, and the oopses in it
        self.guest_shell: GuestShell | None = None  # the shell run() talks to (its own port, or the console)
        self._closed = False
        self._init_running = threading.Event()  # set by _init_runs
        self._boot_failed: list[BaseException] = []
        alive = qemu.alive if qemu is not None else None
        stalled: GuestStalled | None = None
        try:
            t0 = time.monotonic()
            symbols_box: list[Symbols | BaseException] = []
            loader = threading.Thread(target=_load_into, args=(vmlinux, symbols_box, system_map), daemon=True)
            loader.start()
            if console is not None:
                self.console = Console(console, alive)
            if console is not None and boot is None:
                assert self.console is not None
                try:
                    # A VM qprobe did not boot has its shell ready already: no boot to wait for.
                    self.guest_shell = open_shell(self.console, shell, alive, boot_timeout if qemu else None,
                                                  self._boot_setup(vmlinux, None, stall=True))  # fmt: skip
                except GuestPanicked as exc:
                    raise BootPanic(str(exc)) from None
                except GuestStalled as exc:
                    stalled = exc  # raised once attached far enough to say where its vCPUs are
                if qemu is not None:
                    self.timings["boot"] = time.monotonic() - t0
            self.gdb = open_stub(transport, gdb_address, alive)
            self.gdb.handshake()
            self.arch = arch_of(self.gdb)
            if not isinstance(self.gdb, GdbMiRemote):  # gdb writes registers itself
                self.gdb.allow_g(self.arch.registers.plain)
            vcpus = self.gdb.threads()
            drop_stale_breakpoints(self.gdb.request, vcpus)  # a killed qprobe's, before anything runs
            regs0 = self.gdb.read_registers(vcpus[0])
            self._check_stage(self.arch.boot_stage(regs0), boot is not None)
            phys: PhysReader = SharedRam(ram, ram_size, writable=True) if ram is not None else _StubPhys(self.gdb)
            paging = self.arch.page_tables(regs0)
            root = regs0[self.arch.registers.page_table]
            self.mem = GuestMemory(phys, paging.root(root), paging)
            loader.join()
            if isinstance(symbols_box[0], BaseException):
                raise symbols_box[0]
            self.symbols: Symbols = symbols_box[0]
            self.timings["symbols"] = self._symbol_time
            if vmlinux_arch(self.symbols).name != self.arch.name:
                raise TargetError(f"{self.symbols.path.name} is not a vmlinux for {self.arch.name}")
            if boot is not None:
                if isinstance(self.gdb, GdbMiRemote):
                    raise TargetError("boot-time probes need qprobe's own gdbstub client (transport rsp)")
                self._boot_halted(boot, phys, doorbell, shell, boot_timeout)
                self.timings["attach"] = time.monotonic() - t0 - self.timings["boot"]
                _register_cleanup(self)
                return
            paging.learn(self.symbols.__contains__)
            self.mem.pgd = self.mem.pgd_of(root)
            self.slide = detect_slide(self.symbols, self.mem, self.console.text if self.console else "")
            if stalled is not None:
                stalled.add_note(f"when it stalled: {vcpu_places(self.gdb, self.arch, self.symbols)}")
                raise stalled
            # vCPU 0's page tables may be a user process's (idle borrows the last mm): valid now,
            # freed and reused once that process exits.  From here on walk the kernel's own.
            if paging.kernel_root_symbol in self.symbols:
                self.mem.pgd = self.mem.virt_to_phys(self.symbols.address(paging.kernel_root_symbol))
            if isinstance(self.gdb, GdbMiRemote):
                # For the shell's raw ``gdb CMD``: symbols at the running kernel's addresses, DWARF through
                # the index cache the shell's static gdb also uses (1 s once it holds this build, 20 s before).
                t = time.monotonic()
                self.gdb.load_symbols(self.symbols.path, self.slide, index_dir=cache_dir("gdb-index"))
                self.timings["gdb symbols"] = time.monotonic() - t
            self.cmdline = self._read_cmdline()
            sweep_journals()  # those of VMs that are gone
            qemu_pid = self.qemu.proc.pid if self.qemu is not None else listener_pid(parse_address(gdb_address))
            self.journal = Journal(vm_identity(self.symbols, self.slide, self.mem),
                                   process_identity(qemu_pid) if qemu_pid is not None else None)  # fmt: skip
            if self.qemu is not None:
                self.qemu.remove_with_vm(self.journal.files())  # by the janitor, should this process be killed
            self.kernel = KernelData(self.symbols, self.mem, self.arch)
            self.recovered = recover(self.gdb, self.kernel, self.arch, self.journal,
                                     fully_preemptible(self.symbols, self.cmdline))  # fmt: skip
            self.machine = Machine(self.gdb, self.mem, self.journal, self.arch.registers.pc)
            self._machine_set(phys)
            self._probing(phys, doorbell)
            self.timings["attach"] = time.monotonic() - t0
        except BaseException as exc:
            cause: BaseException = exc
            if stalled is not None and exc is not stalled and isinstance(exc, QprobeError):
                stalled.add_note(f"where its vCPUs were is not known: {exc}")
                cause = stalled
            kept = self._keep_console_log(cause)
            self._teardown()
            if kept:
                cause.add_note(f"guest console kept in {kept}")
            if cause is not exc:
                raise cause from None  # the stall is the cause all the same
            raise
        _register_cleanup(self)

    _symbol_time = 0.0
    _leave_halted = False  # ends the connection without a detach, which would start the VM

    def _check_stage(self, stage: BootStage, boot: bool) -> None:
        """Boot-time probes need a kernel that has not run; anything else one that runs.

        A VM that has run no instruction is left so when this attach fails before the boot goes on, so that
        another can (a detach would start it)."""
        self._leave_halted = stage is BootStage.RESET
        if boot and stage is BootStage.KERNEL:
            raise TargetError("boot-time probes need a VM whose kernel has not run yet (QEMU started with -S): "
                              "this one's vCPU 0 has paging on")  # fmt: skip
        if not boot and stage is BootStage.RESET:
            raise TargetError("the VM has not started (QEMU -S: vCPU 0 is at its reset vector) and there is no "
                              "kernel to attach to yet: give boot-time probes (probes= / trace --boot) or let it "
                              "boot first; it is left halted")  # fmt: skip
        if not boot and stage is BootStage.EARLY:
            raise TargetError("the VM's kernel is not up yet (vCPU 0 runs without paging): attach once it has booted")

    def _machine_set(self, phys: PhysReader) -> None:
        self.machine.exit_hint = self._exit_hint
        if isinstance(phys, SharedRam) and phys.writable:
            self.machine.data_writer = phys
        if isinstance(phys, _StubPhys):
            phys.machine = self.machine

    def _probing(self, phys: PhysReader, doorbell: Path | None) -> None:
        """The probe managers, once the kernel's slide and command line are known."""
        reservation = memmap_reservation(self.cmdline)
        if reservation is None:
            raise TargetError("the kernel was not booted with a memmap=2M$ADDR reservation, which qprobe needs for "
                              "its scratch area: add e.g. memmap=2M$0x1e000000 to the kernel command line")  # fmt: skip
        self.scratch = ScratchArea(self.machine, reservation[0], self.symbols.address("_end"), reservation[1])
        self.kprobes = KprobeManager(self.machine, self.kernel, self.scratch, self.arch,
                                     phys if isinstance(phys, SharedRam) else None,
                                     str(doorbell) if doorbell else None,
                                     fully_preemptible(self.symbols, self.cmdline))  # fmt: skip
        self.kretprobes = KretprobeManager(self.kprobes)
        self.uprobes = UprobeManager(self.machine, self.arch, self.kernel, self.kprobes)
        self.kprobe_backend = KprobeBackend(self.kprobes, self.kretprobes)  # what kprobe events hold probes by
        self.uprobe_backend = UprobeBackend(self.uprobes)  # and uprobe events theirs
        self.clock = HitClock(self.kernel, self.machine, self.timeline)  # when each event hit happened
        self.watchpoints = Watchpoints(self.machine, self.symbols, self.kprobes.handlers, self.kprobes.make_regs)

    # -- boot-time probes ------------------------------------------------------------
    def _boot_halted(self, plan: BootPlan, phys: PhysReader, doorbell: Path | None, shell: Path | None,
                     boot_timeout: float) -> None:  # fmt: skip
        """Probe a kernel that has not run yet: find its slide as it boots, arm ``plan``'s probes there.

        Until the kernel has run, its page tables, command line and random values are not in memory:
        what the attach path reads of them is taken from QEMU's configuration (the command line), from
        the boot CPU at the slide's stop (the page tables) or once the kernel is up (the rest: once the
        guest's shell is, or on a QEMU qprobe did not start, once init runs).
        """
        if plan.cmdline is None:
            raise TargetError(f"boot-time probes need the kernel's command line (nokaslr, the memmap= reservation, "
                              f"preemption): {plan.unknown}; give kernel_cmdline=ARGS / --kernel-cmdline "
                              "ARGS")  # fmt: skip
        nokaslr = "nokaslr" in plan.cmdline.split()  # the decompressor leaves the kernel where it is linked
        if plan.image is None and not nokaslr:
            raise TargetError(f"boot-time probes need the kernel image QEMU boots (its KASLR alignment): "
                              f"{plan.unknown}; give kernel_image=PATH / --kernel-image PATH")  # fmt: skip
        if self.qemu is None and INIT_EXEC not in self.symbols:
            raise TargetError(f"{self.symbols.path.name} has no {INIT_EXEC} (Linux 5.9 and later), where a boot "
                              "qprobe did not start is seen to end")  # fmt: skip
        sweep_journals()
        self.cmdline = plan.cmdline  # the kernel's saved_command_line is start_kernel's
        self.slide = 0
        self.recovered = 0  # a VM that has not run holds nothing of an earlier qprobe
        qemu_pid = self.qemu.proc.pid if self.qemu is not None else listener_pid(parse_address(self.address))
        # Its name until the kernel has drawn the values vm_identity reads (_after_boot renames it).
        self.journal = Journal(f"{self.symbols.build_id}-boot-{qemu_pid or f'remote-{os.getpid()}'}",
                               process_identity(qemu_pid) if qemu_pid is not None else None)  # fmt: skip
        self.kernel = KernelData(self.symbols, self.mem, self.arch)
        self.machine = Machine(self.gdb, self.mem, self.journal, self.arch.registers.pc, paused=True)
        self._machine_set(phys)
        align = 0 if plan.image is None else image_alignment(plan.image)
        slide = BootSlide(self.machine, self.symbols, self.arch, align, plan.cmdline,
                          phys if isinstance(phys, SharedRam) else None)  # fmt: skip
        self.boot_slide = slide
        found = threading.Event()
        failed: list[BaseException] = []

        def on_failed(exc: BaseException) -> None:
            failed.append(exc)
            found.set()

        def on_found(tid: str, regs: dict[str, int], at: int) -> None:
            try:
                self._armed_at_boot(regs, at, plan, phys, doorbell)
            except BaseException as exc:  # the main thread raises it; the kernel boots on unprobed meanwhile
                failed.append(exc)
            finally:
                found.set()

        self._leave_halted = False  # the breakpoints going in now must go with a detach
        self.machine.call(lambda: slide.arm(on_found, on_failed))
        t0 = time.monotonic()
        self.machine.resume()
        self._wait_boot(found, boot_timeout, t0, lambda: f"reach {self.symbols.symbolize(slide.entry)} (qprobe "
                        f"was waiting for {slide.waiting_for()})")  # fmt: skip
        if failed:
            raise failed[0]
        if self.qemu is None:
            # No boot of its own to watch: the kernel is up once init runs (_init_runs); the shell, on a
            # port of its own, when qprobe's /init says so, as on qprobe's own boot.
            self._wait_boot(self._init_running, boot_timeout, t0, lambda: f"exec init ({INIT_EXEC})")
            if self._boot_failed:
                raise self._boot_failed[0]
        if self.console is not None:
            alive = self.qemu.alive if self.qemu is not None else None
            wait = boot_timeout if self.qemu is not None or shell is not None else None
            try:
                self.guest_shell = open_shell(self.console, shell, alive, wait,
                                              self._boot_setup(self.symbols.path, plan.cmdline))  # fmt: skip
            except GuestPanicked as exc:
                raise BootPanic(str(exc)) from None
        self.timings["boot"] = time.monotonic() - t0
        if self.qemu is not None:
            self.machine.call(self._after_boot)
        # The guest's shell is up, or init was exec'd, so kernel_init has run free_initmem and mark_readonly
        # (init/main.c): the text boot rewrites is final (alternatives and static calls are patched in
        # start_kernel, __fentry__ sites by ftrace_init, __init text is gone).  What stays rewritable at run
        # time (jump-label and static-call sites, the int3 path refuses them) stays on stub breakpoints.
        self.kprobes.optimizer.queue.optimize_later(self.machine.call(self.kprobes.switch_from_boot))

    def _boot_setup(self, vmlinux: str | Path, cmdline: str | None, stall: bool = False) -> BootSetup:
        """What a console that shows why the guest will not start qprobe's shell names: the image, or the
        vmlinux of a QEMU qprobe did not start, with its command line and disk as far as they are known.
        ``stall``: a kernel silent in its own boot is a verdict (no probe of qprobe's is in it)."""
        if self.qemu is None:
            return BootSetup(Path(vmlinux).name, cmdline or "", stall=stall)
        config = self.qemu.config
        return BootSetup(config.name or config.kernel.name, self.qemu.kernel_cmdline,
                         config.disk_interface if config.disk is not None else None, stall)  # fmt: skip

    def _wait_boot(self, done: threading.Event, timeout: float, t0: float, what: Callable[[], str]) -> None:
        while not done.wait(LIVENESS_POLL):
            self.machine.check_alive()
            if time.monotonic() - t0 > timeout:
                raise TargetError(f"the kernel did not {what()} within {timeout:.0f} s")

    def _armed_at_boot(self, regs: dict[str, int], slide: int, plan: BootPlan, phys: PhysReader,
                       doorbell: Path | None) -> None:  # fmt: skip
        """The boot CPU on its first virtual instruction (stop loop): the kernel's page tables are its,
        the slide known; the probes go in before it runs on."""
        paging = self.arch.page_tables(regs)
        paging.learn(self.symbols.__contains__)
        self.mem.paging = paging
        self.mem.pgd = self.mem.pgd_of(regs[self.arch.registers.page_table])
        if not check_slide(self.symbols, self.mem, slide):
            raise VmlinuxMismatch(f"{self.symbols.path.name} is not the kernel that boots: its banner and "
                                  f"build-id are not at slide {slide:#x}")  # fmt: skip
        self.symbols.slide = self.slide = slide
        self.symbols.init_text = True
        # drgn walks the boot CPU's page tables (in the kernel image, as the image's own mapping places it)
        # until the kernel has its own.
        text = self.symbols.address("_text")
        self.kernel.early_root = self.mem.pgd + text - self.mem.virt_to_phys(text)
        self._probing(phys, doorbell)
        self.kprobes.booting = True  # no int3 until the kernel has booted: stub breakpoints, switched then
        # The guest's clocks do not run until start_kernel has set them up: hits are timed by the host's.
        self.clock.host_only("the probes were armed before the guest's clocks ran (boot-time probes)")
        # First, so that the user's probes there read through the tables it switches to.
        self.kprobes.register_kprobe(InternalProbe("start_kernel", anywhere=True, pre_handler=self._kernel_tables))
        self.kprobes.register_kprobe(InternalProbe("free_initmem", anywhere=True, pre_handler=self._init_freed))
        plan.arm(self)

    def _kernel_tables(self, kp: Kprobe, regs: PtRegs) -> int:
        """At start_kernel (stop loop): x86_64_start_kernel has put the kernel image's mapping into the
        kernel's own page tables, which setup_arch completes and switches to, and boot is about to clear
        the early ones: reads go through the kernel's own from here on."""
        paging = self.mem.paging
        if paging.kernel_root_symbol in self.symbols:
            self.mem.pgd = self.mem.virt_to_phys(self.symbols.address(paging.kernel_root_symbol))
            self.kernel.reopen()
        self.kprobes.unregister_kprobe(kp)
        return 0

    def _init_freed(self, kp: Kprobe, regs: PtRegs) -> int:
        """At free_initmem (stop loop): __init text is about to go.  Its probes are retired as the kernel's
        kprobe_free_init_mem retires its own there (listed [GONE], counts kept), the calls in flight that
        would return into it forgotten, and no probe may go there any more."""
        gone = self.symbols.is_init_text
        self.kretprobes.stub_returns.retire(gone)
        n = self.kprobes.stubs.retire(gone)
        self.symbols.init_text = False
        self.kprobes.unregister_kprobe(kp)
        if self.qemu is None:
            # Only from here: a usermode helper (modprobe) execs earlier, during the initcalls.
            self.kprobes.register_kprobe(InternalProbe(INIT_EXEC, anywhere=True, pre_handler=self._init_runs))
        log.debug("__init text freed: %d probes there retired", n)
        return 0

    def _init_runs(self, kp: Kprobe, regs: PtRegs) -> int:
        """At init's exec, after __init text is freed (stop loop), on a boot qprobe did not start: the kernel
        is up as far as _after_boot reads it.  A usermode helper's exec (a kworker's, not pid 1) is not it."""
        if self.kernel.read_task(percpu_base=regs.percpu_base).pid != 1:
            return 0
        self.kprobes.unregister_kprobe(kp)
        try:
            self._after_boot()
        except BaseException as exc:  # the main thread raises it
            self._boot_failed.append(exc)
        finally:
            self._init_running.set()
        return 0

    def _after_boot(self) -> None:
        """The kernel has booted, to its shell or to init's exec (stop loop): its own page tables, command
        line and drawn values as an attach would read them."""
        paging = self.mem.paging
        # The early page tables the slide was found through are gone: walk a vCPU's, then the kernel's own.
        self.mem.pgd = self.mem.pgd_of(self.gdb.read_registers(self.machine.vcpus[0])[self.arch.registers.page_table])
        if paging.kernel_root_symbol in self.symbols:
            self.mem.pgd = self.mem.virt_to_phys(self.symbols.address(paging.kernel_root_symbol))
        self.cmdline = self._read_cmdline()
        self.kernel.reopen()
        journal = Journal(vm_identity(self.symbols, self.slide, self.mem), self.journal.qemu)
        journal.set_meta(**self.journal.meta)  # the scratch area's places
        for patch in self.journal.patches.values():
            journal.record(patch)
        self.journal.clear()
        self.journal = self.machine.journal = journal
        if self.qemu is not None:
            self.qemu.remove_with_vm(journal.files())

    def _read_cmdline(self) -> str:
        ptr = self.mem.read_u64(self.symbols.address("saved_command_line"))
        return self.mem.read_cstring(ptr, 4096).decode(errors="replace")

    def _keep_console_log(self, why: BaseException) -> Path | None:
        """Copy a failed VM's console log before its run directory goes, qprobe's reason and notes last."""
        if self.qemu is None or not self.qemu.console_log.exists():
            return None
        dest = cache_dir("logs") / f"console-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        said = "; ".join([str(why), *getattr(why, "__notes__", [])])
        write_private(dest, self.qemu.console_log.read_bytes() + f"\n[qprobe: {said}]\n".encode())
        return dest

    def _exit_hint(self) -> str | None:
        """What the console says about the end of the VM."""
        if self.console is None:
            return None
        self.console.wait_closed(1.0)  # QEMU's last words may still be in flight
        text = self.console.text
        panic = next((line for line in text.splitlines() if "Kernel panic" in line), None)
        if panic:
            return f"the guest kernel panicked: {panic.strip()[:120]}"
        if "reboot: Restarting system" in text or "reboot: Power down" in text:
            return "the guest rebooted or powered off; QEMU runs with -no-reboot, so the VM and its probes ended"
        return None

    # -- context manager -----------------------------------------------------------
    def __enter__(self) -> Target:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # -- guest interaction -----------------------------------------------------------
    def run(self, command: str, timeout: float = 60.0) -> RunResult:
        """Run a shell command in the guest; its output is exactly what it wrote (stdout and stderr).

        The guest's shell has a serial port of its own when qprobe booted the VM; the kernel's log goes to
        the console (``console``, ``oopses()``), never into a command's output.
        """
        if self.guest_shell is None:
            raise TargetError("this target has no guest shell (attach with console=PATH)")
        self.machine.check_alive()
        try:
            result = self.guest_shell.run(command, timeout)
        except TargetGone:
            self.machine.check_alive(wait=2.0)  # the stop loop knows why QEMU went
            raise
        self.sync()
        return result

    def wait(self, seconds: float | None = None) -> None:
        """Sleep while the VM runs: ``seconds`` (None: until interrupted), or until it is gone (TargetGone).

        A VM that dies (QEMU killed, a panic with panic=-1, a reboot) is noticed within LIVENESS_POLL.
        """
        deadline = None if seconds is None else time.monotonic() + seconds
        while True:
            self.machine.check_alive()
            left = LIVENESS_POLL if deadline is None else min(LIVENESS_POLL, deadline - time.monotonic())
            if left <= 0:
                return
            time.sleep(left)

    @contextlib.contextmanager
    def interrupt_when_gone(self) -> Iterator[None]:
        """Within the block, the VM's death raises GoneInterrupt in the main thread at once, wherever it waits.

        For callers that wait on something other than the VM (a REPL's prompt, a test's sleep): the stop
        loop sees QEMU go within a fraction of a second and sends this process's main thread a SIGINT,
        which the handler set here turns into GoneInterrupt; any other SIGINT goes to the handler it
        replaced.  Outside the main thread (where signals cannot be handled) the block runs as it is.
        """
        from qprobe.errors import GoneInterrupt

        if threading.current_thread() is not threading.main_thread():
            yield
            return
        main = threading.main_thread().ident
        assert main is not None
        lock = threading.Lock()
        state = {"active": True, "sent": False}

        def on_gone() -> None:
            with lock:
                if state["active"]:
                    state["sent"] = True
                    signal.pthread_kill(main, signal.SIGINT)

        def on_sigint(signum: int, frame: FrameType | None) -> None:
            if state["sent"]:
                state["sent"] = False  # raised once; the unwinding that follows is left alone
                try:
                    self.machine.check_alive()
                except TargetGone as exc:
                    raise GoneInterrupt(exc) from None
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt

        previous = signal.signal(signal.SIGINT, on_sigint)
        self.machine.gone_watchers.append(on_gone)
        try:
            self.machine.check_alive()  # gone before the block: the watcher will not be called
            yield
        finally:
            with lock:
                state["active"] = False
            self.machine.gone_watchers.remove(on_gone)
            signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)

    def sync(self) -> None:
        """Bring ``nhit``/``nmissed`` and event records up to date with what the guest did so far.

        In-guest counters and record rings are otherwise folded every 20 ms; ``run()`` calls
        this when the command is done, so counts read right after it are exact.
        """
        self.kprobes.optimizer.sync_all()
        self.timeline.flush()

    def read(self, addr: int | str, size: int) -> bytes:
        """Kernel virtual memory, read from shared RAM without stopping the VM."""
        return self.mem.read(self.symbols.resolve(addr) if isinstance(addr, str) else addr, size)

    @property
    def records_lossy(self) -> bool:
        """What a full record ring does with a hit: make the hitting vCPU wait until the host has drained it
        (False, the default: no trace line lost), or drop the record and count it lost (True, as perf's and
        bpftrace's rings do)."""
        records = self.kprobes.optimizer.records
        return records is not None and records.lossy

    @records_lossy.setter
    def records_lossy(self, on: bool) -> None:
        records = self.kprobes.optimizer.records
        if records is None:
            if on:
                raise TargetError("records go through guest rings only on qprobe's own QEMU (shared RAM)")
            return
        records.set_lossy(on)

    def record_waits(self) -> int:
        """Hits that found their CPU's record ring full and waited for the host to drain it."""
        records = self.kprobes.optimizer.records
        return records.waits() if records is not None else 0

    def release_serial_ports(self) -> None:
        """Close the console and the guest shell's port (each of QEMU's takes one client at a time)."""
        if self.guest_shell is not None and self.guest_shell.port is not self.console:
            self.guest_shell.close()
        if self.console is not None:
            self.console.close()

    def interrupt_guest(self) -> None:
        """Ctrl-C the guest shell's foreground command (as ``run`` started it)."""
        if self.guest_shell is not None:
            self.guest_shell.interrupt()

    def oopses(self) -> list[str]:
        """The kernel's oops, BUG, WARNING and panic lines on its console since qprobe connected."""
        return self.console.oopses() if self.console else []

    def registers(self, vcpu: int = 0) -> dict[str, int]:
        tid = self.machine.vcpus[vcpu]
        return self.machine.call(lambda: self.gdb.read_registers(tid))

    @property
    def vcpus(self) -> int:
        return len(self.machine.vcpus)

    def stack_trace(self, vcpu: int = 0) -> tuple[dict[str, int], Stack | None]:
        """A vCPU's registers and, when it is in the kernel, its kernel stack (None in user mode).

        Read with every vCPU stopped, so that the stack does not change under the unwinder.
        """
        tid = self.machine.vcpus[vcpu]

        def unwind() -> tuple[dict[str, int], Stack | None]:
            values = self.gdb.read_registers(tid)
            if self.arch.user_mode(values):
                return values, None
            return values, self.kprobes.make_regs(values, tid).stack_trace()

        return self.machine.call(unwind)

    def gdb_command(self, command: str) -> str | None:
        """A gdb CLI command on the live gdbstub and what it printed; None unless the transport is gdb's.

        gdb may only talk to the stub while the VM is stopped: it runs on the stop loop.
        """
        gdb = self.gdb
        if not isinstance(gdb, GdbMiRemote):
            return None
        return self.machine.call(lambda: gdb.console(command))

    @property
    def prog(self) -> drgn.Program:
        """The running guest kernel as a drgn ``Program``, created on first use and kept.

        drgn's helpers work on it while probes stay armed, reading guest RAM
        as it is at the moment of the read (in a handler: as it is at the hit,
        the hitting vCPU waits)::

            from drgn.helpers.linux.pid import for_each_task
            comms = [t.comm.string_() for t in for_each_task(target.prog)]
        """
        return self.kernel.prog

    def var(self, name: str) -> drgn.Object:
        """A kernel variable as a drgn ``Object`` (``target.var("jiffies").value_()``), typed by the debug info.

        A per-CPU variable is its offset, as in C: ``drgn.helpers.linux.percpu.per_cpu(var, cpu)``.
        """
        try:
            return self.prog[name]
        except KeyError:
            raise SymbolError(f"no kernel variable {name!r} in {self.symbols.path.name}'s debug info") from None

    def current(self, regs: PtRegs) -> drgn.Object:
        """The task a handler interrupted, as drgn's ``struct task_struct *`` (``current.comm.string_()``)."""
        return self.kernel.current(regs.percpu_base)

    def current_task(self, regs: PtRegs) -> Task:
        """A snapshot of the task a handler interrupted: pid, tgid and comm as Python values."""
        return self.kernel.read_task(percpu_base=regs.percpu_base)

    # -- teardown ------------------------------------------------------------------
    def close(self) -> None:
        """Remove every probe, detach, and stop our own QEMU."""
        if self._closed:
            return
        self._closed = True
        _unregister_cleanup(self)
        try:
            if hasattr(self, "kprobes") and self.machine.alive:
                self.events.clear()
                self.uprobes.remove_all()
                self.kretprobes.remove_all()
                self.kprobes.remove_all()
                self.journal.clear()
        except QprobeError as exc:
            log.warning("could not remove every probe: %s", exc)
        finally:
            self.timeline.close()
            # Whatever happened above, QEMU (if ours) is stopped and nothing is leaked.
            self._teardown()

    def _teardown(self) -> None:
        machine = getattr(self, "machine", None)
        try:
            if machine is not None:
                machine.close(detach=not self._leave_halted)
            elif hasattr(self, "gdb"):
                try:
                    if self._leave_halted:
                        self.gdb.close()
                    else:
                        self.gdb.detach()
                except QprobeError:
                    pass
        finally:  # whatever the gdbstub did, our QEMU is stopped
            kernel = getattr(self, "kernel", None)
            if kernel is not None:
                kernel.close()
            try:
                self.release_serial_ports()
            finally:
                if self.qemu is not None:
                    self.qemu.terminate()
                    journal = getattr(self, "journal", None)
                    if journal is not None:
                        journal.clear()  # of no use once its VM is gone


def vm_identity(symbols: Symbols, slide: int, mem: GuestMemory) -> str:
    """What tells this boot of this VM from every other: the name of its undo journal.

    The build-id and KASLR slide, and a digest of values the kernel drew at
    random while booting and never changes afterwards (the key that hashes
    printed pointers, the randomized bases of the direct map, vmalloc and
    vmemmap), so that two VMs of one kernel booted with nokaslr still differ,
    and every address spelling of one VM agrees.  (The per-CPU stack canary
    would not do: it is switched with every task.)
    """
    sizes = {"ptr_key": 16, "page_offset_base": 8, "vmalloc_base": 8, "vmemmap_base": 8}
    drawn = b"".join(mem.read(symbols.address(n), size) for n, size in sizes.items() if n in symbols)
    return f"{symbols.build_id}-{slide:x}-{hashlib.sha256(drawn).hexdigest()[:16]}"


def _load_into(vmlinux: str | Path, box: list[Symbols | BaseException], system_map: Path | None = None) -> None:
    t = time.monotonic()
    try:
        box.append(Symbols.load(vmlinux, system_map))
    except BaseException as exc:
        box.append(exc)
    Target._symbol_time = time.monotonic() - t


# -- cleanup on exit and on SIGTERM ------------------------------------------------------
_live: set[Target] = set()
_handlers_installed = False


def _register_cleanup(target: Target) -> None:
    global _handlers_installed
    _live.add(target)
    if not _handlers_installed and threading.current_thread() is threading.main_thread():
        _handlers_installed = True
        atexit.register(_close_all)
        # SIGTERM and SIGHUP (a closed terminal, an ended tmux session) unwind like Ctrl-C
        # does, so every ``with`` block and finally clause removes its probes before the end.
        for signum in UNWIND_SIGNALS:
            if signal.getsignal(signum) in (signal.SIG_DFL, None):
                signal.signal(signum, unwind_on_signal)


def _unregister_cleanup(target: Target) -> None:
    _live.discard(target)


UNWIND_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def unwind_on_signal(signum: int, frame: object) -> None:
    """A signal handler that ends the process the way ``sys.exit`` does (status 128 + signal)."""
    raise SystemExit(128 + signum)


def _close_all() -> None:
    for t in list(_live):
        t.close()


__all__ = ["UNWIND_SIGNALS", "BootPlan", "Target", "arch_of", "open_stub", "unwind_on_signal", "vm_identity"]
