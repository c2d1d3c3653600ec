"""How a Target is put together from a gdbstub address and a vmlinux: the stub's client, the architecture,
guest memory and symbols, the stop loop, the undo journal, and the probe managers over them.

The composition root: the one module above qprobe/arch that asks qprobe.arch.select for an Arch.
:class:`Wiring` makes a target's :class:`qprobe.parts.Parts` and the objects a Target is a façade over,
each on those parts (its kprobes and kprobe_events APIs, its guest, its kernel views, its lifetime), and
assigns the parts as it builds them: ``connect`` as far as any target goes, then ``attach_running`` for a
kernel that runs; a kernel that has not run yet is wired as it boots (qprobe.bootprobes), with
``new_machine`` and ``probing``.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from qprobe.arch import Arch, BootStage
from qprobe.arch.select import arch_named, arch_of_machine
from qprobe.core.kprobes import KprobeManager
from qprobe.core.kretprobe import KretprobeManager
from qprobe.core.recovery import recover
from qprobe.core.regsmaker import RegsMaker
from qprobe.core.table import ProbeTable
from qprobe.core.uguest import GuestUprobes
from qprobe.core.uprobes import UprobeManager
from qprobe.core.watchpoint import Watchpoints
from qprobe.errors import BootPanic, GuestPanicked, GuestStalled, MemoryFault, QprobeError, TargetError
from qprobe.eventapi import EventAPI
from qprobe.events.clock import HitClock
from qprobe.events.kprobe import KprobeBackend
from qprobe.events.uprobe import UprobeBackend
from qprobe.guest import Guest
from qprobe.kernel.features import fully_preemptible
from qprobe.kernel.kaslr import detect_slide
from qprobe.kernel.program import KernelData
from qprobe.kernel.stalled import vcpu_places
from qprobe.kernel.symbols import Symbols
from qprobe.kernel.vmlinux import elf_machine
from qprobe.lifetime import Lifetime
from qprobe.parts import Parts
from qprobe.paths import cache_dir
from qprobe.probeapi import ProbeAPI
from qprobe.views import KernelViews
from qprobe.vmm.boards import board_for
from qprobe.vmm.bootfail import BootSetup
from qprobe.vmm.connection import Connection, parse_address
from qprobe.vmm.console import Console, open_shell
from qprobe.vmm.gdbmi import GdbMiRemote
from qprobe.vmm.gdbremote import GdbRemote, drop_stale_breakpoints
from qprobe.vmm.journal import Journal, sweep_journals
from qprobe.vmm.machine import Machine
from qprobe.vmm.memory import GuestMemory, PhysReader, SharedRam
from qprobe.vmm.peer import listener_pid, process_identity
from qprobe.vmm.scratch import ScratchArea

if TYPE_CHECKING:
    from qprobe.vmm.qemu import QemuProcess
    from qprobe.vmm.transport import GdbTransport

TRANSPORTS = ("rsp", "gdb")


def arch_of(gdb: GdbRemote | GdbMiRemote) -> Arch:
    """The target's architecture, by the name its gdbstub's target description gives it; its registers there."""
    if not gdb.architecture:
        raise TargetError("the gdbstub's target description names no architecture (<architecture>)")
    arch = arch_named(gdb.architecture)
    layout = arch.registers
    missing = sorted(layout.stop_registers - set(gdb.regs))
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


class StubPhys:
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


def read_cmdline(mem: GuestMemory, symbols: Symbols) -> str:
    """The running kernel's command line (saved_command_line)."""
    ptr = mem.read_u64(symbols.address("saved_command_line"))
    return mem.read_cstring(ptr, 4096).decode(errors="replace")


def check_stage(stage: BootStage, boot: bool) -> None:
    """Boot-time probes need a kernel that has not run; anything else one that runs."""
    if boot and stage is BootStage.KERNEL:
        raise TargetError("boot-time probes need a VM whose kernel has not run yet (QEMU started with -S): "
                          "this one's vCPU 0 has paging on")  # fmt: skip
    if not boot and stage is BootStage.RESET:
        raise TargetError("the VM has not started (QEMU -S: vCPU 0 is at its reset vector) and there is no "
                          "kernel to attach to yet: give boot-time probes (probes= / trace --boot) or let it "
                          "boot first; it is left halted")  # fmt: skip
    if not boot and stage is BootStage.EARLY:
        raise TargetError("the VM's kernel is not up yet (vCPU 0 runs without paging): attach once it has booted")


class SymbolsLoader:
    """vmlinux's symbols, read on a thread of their own while the gdbstub is connected."""

    def __init__(self, vmlinux: str | Path, system_map: Path | None) -> None:
        self.seconds = 0.0
        self._box: list[Symbols | BaseException] = []
        self._thread = threading.Thread(target=self._load, args=(vmlinux, system_map), daemon=True)
        self._thread.start()

    def _load(self, vmlinux: str | Path, system_map: Path | None) -> None:
        t = time.monotonic()
        try:
            self._box.append(Symbols.load(vmlinux, system_map))
        except BaseException as exc:
            self._box.append(exc)
        self.seconds = time.monotonic() - t

    def join(self) -> Symbols:
        """The symbols, once read; what reading them raised, raised here."""
        self._thread.join()
        if isinstance(self._box[0], BaseException):
            raise self._box[0]
        return self._box[0]


class Wiring:
    """Puts a target together from what ``Target(...)`` was given: its parts, and the objects over them."""

    def __init__(self, gdb_address: str, vmlinux: str | Path, *, qemu: QemuProcess | None, ram: Path | None,
                 ram_size: int, console: Path | None, boot_timeout: float, doorbell: Path | None, shell: Path | None,
                 system_map: Path | None, transport: str) -> None:  # fmt: skip
        self.parts = parts = Parts(qemu, gdb_address)
        self.lifetime = Lifetime(parts)
        self.guest = Guest(parts)
        self.views = KernelViews(parts)
        self.probe_api = ProbeAPI(parts)
        self.event_api = EventAPI(parts, self.guest.run)
        self.vmlinux, self.system_map, self.transport = vmlinux, system_map, transport
        self.ram, self.ram_size, self.doorbell = ram, ram_size, doorbell
        self.console_path, self.shell_path, self.boot_timeout = console, shell, boot_timeout
        self.alive = qemu.alive if qemu is not None else None
        self.t0 = time.monotonic()
        self.root = 0  # vCPU 0's page-table register when connected
        self.kernel_pcs: list[int] = []  # the pcs of the vCPUs in kernel mode when connected
        self.stalled: GuestStalled | None = None  # a kernel silent in its own boot, said once attached

    def connect(self, boot: bool) -> None:
        """The console (and, but for a boot to probe, the guest's shell), the stub, the architecture, guest
        memory as vCPU 0's page tables map it, and the symbols: as far as every target goes."""
        t = self.parts
        loader = SymbolsLoader(self.vmlinux, self.system_map)
        if self.console_path is not None:
            t.console = Console(self.console_path, self.alive)
            if not boot:
                self._open_shell(t.console)
        t.gdb = open_stub(self.transport, t.address, self.alive)
        t.gdb.handshake()
        t.arch = arch_of(t.gdb)
        # gdb writes registers itself, and reads with ``p`` those ``g`` lacks (failing a read that lacks one).
        if not isinstance(t.gdb, GdbMiRemote):
            t.gdb.allow_g(t.arch.registers.plain)
            t.gdb.needed = t.arch.registers.stop_registers
        vcpus = t.gdb.threads()
        drop_stale_breakpoints(t.gdb.request, vcpus)  # a killed qprobe's, before anything runs
        regs0 = t.gdb.read_registers(vcpus[0])
        board = board_for(t.arch.name)
        stage = t.arch.boot.boot_stage(regs0)
        if stage is BootStage.EARLY and t.arch.ip(regs0) in board.reset_pcs:
            stage = BootStage.RESET
        # Where the vCPUs in the kernel are: in its text, which finds a KASLR slide without a window to scan.
        in_kernel = [regs0] + [t.gdb.read_registers(v) for v in vcpus[1:]] if stage is BootStage.KERNEL else []
        self.kernel_pcs = [t.arch.ip(r) for r in in_kernel if not t.arch.user_mode(r)]
        # A VM that has run no instruction is left so when this attach fails before the boot goes on, so that
        # another can (a detach would start it).
        self.lifetime.leave_halted = stage is BootStage.RESET
        check_stage(stage, boot)
        phys: PhysReader = (StubPhys(t.gdb) if self.ram is None
                            else SharedRam(self.ram, self.ram_size, writable=True, base=board.ram_base))  # fmt: skip
        paging = t.arch.page_tables(regs0)
        self.root = regs0[t.arch.registers.page_table]
        t.mem = GuestMemory(phys, paging.root(self.root), paging)
        t.symbols = loader.join()
        t.timings["symbols"] = loader.seconds
        if vmlinux_arch(t.symbols).name != t.arch.name:
            raise TargetError(f"{t.symbols.path.name} is not a vmlinux for {t.arch.name}")

    def _open_shell(self, console: Console) -> None:
        """The guest's shell, once up, on a VM without boot-time probes; a boot that stalls is kept for later."""
        t = self.parts
        try:
            # A VM qprobe did not boot has its shell ready already: no boot to wait for.
            t.guest_shell = open_shell(console, self.shell_path, self.alive, self.boot_timeout if t.qemu else None,
                                       boot_setup(t.qemu, self.vmlinux, None, stall=True))  # fmt: skip
        except GuestPanicked as exc:
            raise BootPanic(str(exc)) from None
        except GuestStalled as exc:
            self.stalled = exc  # raised once attached far enough to say where its vCPUs are
        if t.qemu is not None:
            t.timings["boot"] = time.monotonic() - self.t0

    def attach_running(self) -> None:
        """The rest, for a kernel that runs: its slide, command line and journal, what an earlier qprobe left
        in it undone, the stop loop and the probe managers."""
        t = self.parts
        t.mem.paging.learn(t.symbols.__contains__)
        t.mem.pgd = t.mem.pgd_of(self.root)
        t.slide = detect_slide(t.symbols, t.mem, t.console.text if t.console else "", self.kernel_pcs)
        if self.stalled is not None:
            self.stalled.add_note(f"when it stalled: {vcpu_places(t.gdb, t.arch, t.symbols)}")
            raise self.stalled
        # vCPU 0's page tables may be a user process's (idle borrows the last mm): valid now,
        # freed and reused once that process exits.  From here on walk the kernel's own.
        if t.mem.paging.kernel_root_symbol in t.symbols:
            t.mem.pgd = t.mem.virt_to_phys(t.symbols.address(t.mem.paging.kernel_root_symbol))
        if isinstance(t.gdb, GdbMiRemote):
            # For the shell's raw ``gdb CMD``: symbols at the running kernel's addresses, DWARF through
            # the index cache the shell's static gdb also uses (1 s once it holds this build, 20 s before).
            start = time.monotonic()
            t.gdb.load_symbols(t.symbols.path, t.slide, index_dir=cache_dir("gdb-index"))
            t.timings["gdb symbols"] = time.monotonic() - start
        t.cmdline = read_cmdline(t.mem, t.symbols)
        t.journal = self.new_journal(lambda pid: vm_identity(t.symbols, t.slide, t.mem))
        if t.qemu is not None:
            t.qemu.remove_with_vm(t.journal.files())  # by the janitor, should this process be killed
        t.kernel = KernelData(t.symbols, t.mem, t.arch)
        t.recovered = recover(t.gdb, t.kernel, t.arch, t.journal, fully_preemptible(t.symbols, t.cmdline))
        self.new_machine()
        self.probing()
        t.timings["attach"] = time.monotonic() - self.t0

    def new_journal(self, identity: Callable[[int | None], str]) -> Journal:
        """The undo journal, named ``identity(QEMU's pid)``, once those of VMs that are gone are swept."""
        sweep_journals()
        t = self.parts
        pid = t.qemu.proc.pid if t.qemu is not None else listener_pid(parse_address(t.address))
        return Journal(identity(pid), process_identity(pid) if pid is not None else None)

    def new_machine(self, paused: bool = False) -> Machine:
        """The stop loop over the stub, guest memory and the journal (``paused``: of a VM that has not run)."""
        t = self.parts
        t.machine = Machine(t.gdb, t.mem, t.journal, t.arch.registers.pc, paused=paused)
        t.machine.exit_hint = self.lifetime.exit_hint
        phys = t.mem.phys
        if isinstance(phys, SharedRam) and phys.writable:
            t.machine.data_writer = phys
        if isinstance(phys, StubPhys):
            phys.machine = t.machine
        return t.machine

    def probing(self) -> None:
        """The probe managers, once the kernel's slide and command line are known."""
        t = self.parts
        board = board_for(t.arch.name)
        reservation = board.reserved(t.cmdline)
        if reservation is None:
            example = board.reserve(board.scratch_phys(512 << 20))
            raise TargetError(f"the kernel was not booted with the {board.reservation}= reservation qprobe needs for "
                              f"its scratch area: add e.g. {example} to the kernel command line")  # fmt: skip
        ram = t.mem.phys if isinstance(t.mem.phys, SharedRam) else None
        t.scratch = ScratchArea(t.machine, reservation[0], t.symbols.address("_end"), reservation[1],
                                t.symbols.address("_text"))  # fmt: skip
        t.regs_maker = RegsMaker(t.machine, t.kernel, t.arch)  # every handler's pt_regs
        # The one probe table: registration, the trap path and the optimizer all work on it.
        t.kprobes = KprobeManager(t.machine, t.kernel, t.scratch, t.arch, ProbeTable(), t.regs_maker, ram,
                                  str(self.doorbell) if self.doorbell else None,
                                  fully_preemptible(t.symbols, t.cmdline))  # fmt: skip
        t.optimizer = t.kprobes.optimizer
        t.kretprobes = KretprobeManager(t.kprobes)
        # Uprobes counted, folded or recorded in the guest (into the optimizer's record rings).
        counted = GuestUprobes(t.machine, t.kernel, t.scratch, t.arch, ram, t.optimizer)
        t.uprobes = UprobeManager(t.machine, t.arch, t.kernel, t.kprobes, t.kprobes.handlers, t.regs_maker,
                                  t.kprobes.dispatcher, counted)  # fmt: skip
        t.kprobe_backend = KprobeBackend(t.kprobes, t.kretprobes, t.regs_maker)  # what kprobe events hold probes by
        t.uprobe_backend = UprobeBackend(t.uprobes)  # and uprobe events theirs
        t.clock = HitClock(t.kernel, t.machine, t.timeline)  # when each event hit happened
        t.watchpoints = Watchpoints(t.machine, t.symbols, t.kprobes.handlers, t.regs_maker.make_regs)

    def cause(self, exc: BaseException) -> BaseException:
        """What a failed attach raises for ``exc``: the stall of a kernel silent in its own boot, if it was."""
        stalled = self.stalled
        if stalled is not None and exc is not stalled and isinstance(exc, QprobeError):
            stalled.add_note(f"where its vCPUs were is not known: {exc}")
            return stalled
        return exc


def boot_setup(qemu: QemuProcess | None, vmlinux: str | Path, cmdline: str | None, stall: bool = False) -> BootSetup:
    """What a console that shows why the guest will not start qprobe's shell names: the image, or the
    vmlinux of a QEMU qprobe did not start, with its command line and disk as far as they are known.
    ``stall``: a kernel silent in its own boot is a verdict (no probe of qprobe's is in it)."""
    if qemu is None:
        return BootSetup(Path(vmlinux).name, cmdline or "", stall=stall)
    config = qemu.config
    return BootSetup(config.name or config.kernel.name, qemu.kernel_cmdline,
                     config.disk_interface if config.disk is not None else None, stall)  # fmt: skip


__all__ = [
    "TRANSPORTS",
    "StubPhys",
    "SymbolsLoader",
    "Wiring",
    "arch_of",
    "boot_setup",
    "check_stage",
    "open_stub",
    "read_cmdline",
    "vm_identity",
    "vmlinux_arch",
]
