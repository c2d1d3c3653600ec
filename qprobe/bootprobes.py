"""Boot-time probes: a Target whose QEMU starts halted (-S) probes its kernel from the first instruction on.

:class:`BootProbing` finds the KASLR slide as the kernel boots (qprobe.kernel.bootslide), wires the probe
managers at that stop (qprobe.wiring) and arms the boot plan's probes there, as stub breakpoints; it
follows the kernel through start_kernel (its own page tables), free_initmem (__init text gone) and, on a
boot qprobe did not start, init's exec, and reads what an attach reads once the kernel is up.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from qprobe.core.anywhere import InternalProbe
from qprobe.errors import BootPanic, GuestPanicked, TargetError, VmlinuxMismatch
from qprobe.kernel.bootslide import BootSlide
from qprobe.kernel.bootswitch import SwitchSlide
from qprobe.kernel.kaslr import check_slide, image_alignment
from qprobe.kernel.program import KernelData
from qprobe.lifetime import LIVENESS_POLL
from qprobe.vmm.console import open_shell
from qprobe.vmm.gdbmi import GdbMiRemote
from qprobe.vmm.journal import Journal
from qprobe.vmm.memory import SharedRam
from qprobe.wiring import Wiring, boot_setup, read_cmdline, vm_identity

if TYPE_CHECKING:
    from qprobe.core.kprobe import Kprobe
    from qprobe.core.regs import PtRegs

log = logging.getLogger("qprobe")
# What init's exec runs through (fs/exec.c, since Linux 5.9's "exec: Implement kernel_execve"): a boot qprobe
# did not start, and has no shell of its own to wait for, is up once init runs.
INIT_EXEC = "kernel_execve"


class Plan(Protocol):
    """What the boot plan (qprobe.api.BootPlan) knows of the boot: the kernel image QEMU boots (its KASLR
    alignment), the command line it gives the kernel, and why either is not known (None)."""

    @property
    def image(self) -> Path | None: ...
    @property
    def cmdline(self) -> str | None: ...
    @property
    def unknown(self) -> str: ...


class BootProbing:
    """The boot of a target's kernel, probed from its first instruction (``boot``); ``arm`` registers the
    plan's probes at the slide's stop, as stub breakpoints (nothing else works yet)."""

    def __init__(self, wiring: Wiring, plan: Plan, arm: Callable[[], None]) -> None:
        self.target = wiring.parts  # assigned on as the kernel boots, as the wiring assigns them
        self.wiring = wiring
        self.plan = plan
        self.arm = arm
        self._init_running = threading.Event()  # set by _init_runs
        self._after_boot_failed: list[BaseException] = []  # what _after_boot raised on the stop loop

    def boot(self) -> None:
        """Probe a kernel that has not run yet: find its slide as it boots, arm the plan's probes there.

        Until the kernel has run, its page tables, command line and random values are not in memory:
        what the attach path reads of them is taken from QEMU's configuration (the command line), from
        the boot CPU at the slide's stop (the page tables) or once the kernel is up (the rest: once the
        guest's shell is, or on a QEMU qprobe did not start, once init runs).
        """
        t, plan = self.target, self.plan
        if isinstance(t.gdb, GdbMiRemote):
            raise TargetError("boot-time probes need qprobe's own gdbstub client (transport rsp)")
        if plan.cmdline is None:
            raise TargetError(f"boot-time probes need the kernel's command line (nokaslr, the memmap= reservation, "
                              f"preemption): {plan.unknown}; give kernel_cmdline=ARGS / --kernel-cmdline "
                              "ARGS")  # fmt: skip
        switch = t.arch.boot.arch_boot_switch(t.symbols.file_bytes, t.symbols.address)
        nokaslr = "nokaslr" in plan.cmdline.split()  # the decompressor leaves the kernel where it is linked
        if plan.image is None and not nokaslr and switch is None:
            raise TargetError(f"boot-time probes need the kernel image QEMU boots (its KASLR alignment): "
                              f"{plan.unknown}; give kernel_image=PATH / --kernel-image PATH")  # fmt: skip
        if t.qemu is None and INIT_EXEC not in t.symbols:
            raise TargetError(f"{t.symbols.path.name} has no {INIT_EXEC} (Linux 5.9 and later), where a boot "
                              "qprobe did not start is seen to end")  # fmt: skip
        t.cmdline = plan.cmdline  # the kernel's saved_command_line is start_kernel's
        t.slide = 0
        t.recovered = 0  # a VM that has not run holds nothing of an earlier qprobe
        # Its name until the kernel has drawn the values vm_identity reads (_after_boot renames it).
        t.journal = self.wiring.new_journal(lambda pid: f"{t.symbols.build_id}-boot-{pid or f'remote-{os.getpid()}'}")
        t.kernel = KernelData(t.symbols, t.mem, t.arch)
        machine = self.wiring.new_machine(paused=True)
        slide: BootSlide | SwitchSlide
        if switch is not None:  # a kernel that relocates itself: stopped on its way to its virtual addresses
            slide = SwitchSlide(machine, t.symbols, t.arch, switch, t.mem.phys.read_phys)
        else:
            align = 0 if plan.image is None else image_alignment(plan.image)
            slide = BootSlide(machine, t.symbols, t.arch, align, plan.cmdline,
                              t.mem.phys if isinstance(t.mem.phys, SharedRam) else None)  # fmt: skip
        t.boot_slide = slide
        found = threading.Event()
        failed: list[BaseException] = []

        def on_failed(exc: BaseException) -> None:
            failed.append(exc)
            found.set()

        def on_found(tid: str, regs: dict[str, int], at: int) -> None:
            try:
                self._armed_at_boot(regs, at)
            except BaseException as exc:  # the main thread raises it; the kernel boots on unprobed meanwhile
                failed.append(exc)
            finally:
                found.set()

        self.wiring.lifetime.leave_halted = False  # the breakpoints going in now must go with a detach
        machine.call(lambda: slide.arm(on_found, on_failed))
        t0 = time.monotonic()
        machine.resume()
        self._wait_boot(found, t0, lambda: f"reach {t.symbols.symbolize(slide.entry)} (qprobe "
                        f"was waiting for {slide.waiting_for()})")  # fmt: skip
        if failed:
            raise failed[0]
        if t.qemu is None:
            # No boot of its own to watch: the kernel is up once init runs (_init_runs); the shell, on a
            # port of its own, when qprobe's /init says so, as on qprobe's own boot.
            self._wait_boot(self._init_running, t0, lambda: f"exec init ({INIT_EXEC})")
            if self._after_boot_failed:
                raise self._after_boot_failed[0]
        wiring = self.wiring
        if t.console is not None:
            wait = wiring.boot_timeout if t.qemu is not None or wiring.shell_path is not None else None
            try:
                t.guest_shell = open_shell(t.console, wiring.shell_path, wiring.alive, wait,
                                           boot_setup(t.qemu, t.symbols.path, plan.cmdline))  # fmt: skip
            except GuestPanicked as exc:
                raise BootPanic(str(exc)) from None
        t.timings["boot"] = time.monotonic() - t0
        if t.qemu is not None:
            machine.call(self._after_boot)
        # The guest's shell is up, or init was exec'd, so kernel_init has run free_initmem and mark_readonly
        # (init/main.c): the text boot rewrites is final (alternatives and static calls are patched in
        # start_kernel, __fentry__ sites by ftrace_init, __init text is gone).  What stays rewritable at run
        # time (jump-label and static-call sites, the int3 path refuses them) stays on stub breakpoints.
        t.optimizer.optimize_later(machine.call(t.kprobes.switch_from_boot))
        t.timings["attach"] = time.monotonic() - wiring.t0 - t.timings["boot"]

    def _wait_boot(self, done: threading.Event, t0: float, what: Callable[[], str]) -> None:
        timeout = self.wiring.boot_timeout
        while not done.wait(LIVENESS_POLL):
            self.target.machine.check_alive()
            if time.monotonic() - t0 > timeout:
                raise TargetError(f"the kernel did not {what()} within {timeout:.0f} s")

    def _armed_at_boot(self, regs: dict[str, int], slide: int) -> None:
        """The boot CPU on its first virtual instruction (stop loop): the kernel's page tables are its,
        the slide known; the probes go in before it runs on."""
        t = self.target
        paging = t.arch.page_tables(regs)
        paging.learn(t.symbols.__contains__)
        t.mem.paging = paging
        t.mem.pgd = t.mem.pgd_of(regs[t.arch.registers.page_table])
        if not check_slide(t.symbols, t.mem, slide):
            raise VmlinuxMismatch(f"{t.symbols.path.name} is not the kernel that boots: its banner and "
                                  f"build-id are not at slide {slide:#x}")  # fmt: skip
        t.symbols.slide = t.slide = slide
        t.symbols.init_text = True
        # drgn walks the boot CPU's page tables (in the kernel image, as the image's own mapping places it)
        # until the kernel has its own.
        text = t.symbols.address("_text")
        t.kernel.early_root = t.mem.pgd + text - t.mem.virt_to_phys(text)
        self.wiring.probing()
        t.kprobes.booting = True  # no int3 until the kernel has booted: stub breakpoints, switched then
        # The guest's clocks do not run until start_kernel has set them up: hits are timed by the host's.
        t.clock.host_only("the probes were armed before the guest's clocks ran (boot-time probes)")
        # First, so that the user's probes there read through the tables it switches to.
        t.kprobes.register_kprobe(InternalProbe(paging.kernel_root_from, anywhere=True,
                                                pre_handler=self._kernel_tables))  # fmt: skip
        t.kprobes.register_kprobe(InternalProbe("free_initmem", anywhere=True, pre_handler=self._init_freed))
        self.arm()

    def _kernel_tables(self, kp: Kprobe, regs: PtRegs) -> int:
        """At ``PageTables.kernel_root_from`` (stop loop; x86's start_kernel, arm64's bootmem_init): the kernel's
        own page tables map its image, and boot is about to clear or free the early ones: reads go through the
        kernel's own from here on."""
        t = self.target
        paging = t.mem.paging
        if paging.kernel_root_symbol in t.symbols:
            t.mem.pgd = t.mem.virt_to_phys(t.symbols.address(paging.kernel_root_symbol))
            t.kernel.reopen()
        t.kprobes.unregister_kprobe(kp)
        return 0

    def _init_freed(self, kp: Kprobe, regs: PtRegs) -> int:
        """At free_initmem (stop loop): __init text is about to go.  Its probes are retired as the kernel's
        kprobe_free_init_mem retires its own there (listed [GONE], counts kept), the calls in flight that
        would return into it forgotten, and no probe may go there any more."""
        t = self.target
        gone = t.symbols.is_init_text
        t.kretprobes.stub_returns.retire(gone)
        n = t.kprobes.stubs.retire(gone)
        t.symbols.init_text = False
        t.kprobes.unregister_kprobe(kp)
        if t.qemu is None:
            # Only from here: a usermode helper (modprobe) execs earlier, during the initcalls.
            t.kprobes.register_kprobe(InternalProbe(INIT_EXEC, anywhere=True, pre_handler=self._init_runs))
        log.debug("__init text freed: %d probes there retired", n)
        return 0

    def _init_runs(self, kp: Kprobe, regs: PtRegs) -> int:
        """At init's exec, after __init text is freed (stop loop), on a boot qprobe did not start: the kernel
        is up as far as _after_boot reads it.  A usermode helper's exec (a kworker's, not pid 1) is not it."""
        t = self.target
        if t.kernel.read_task(regs=regs.task_regs).pid != 1:
            return 0
        t.kprobes.unregister_kprobe(kp)
        try:
            self._after_boot()
        except BaseException as exc:  # the main thread raises it
            self._after_boot_failed.append(exc)
        finally:
            self._init_running.set()
        return 0

    def _after_boot(self) -> None:
        """The kernel has booted, to its shell or to init's exec (stop loop): its own page tables, command
        line and drawn values as an attach would read them."""
        t = self.target
        # The early page tables the slide was found through are gone: walk a vCPU's, then the kernel's own, as
        # the vCPU's registers shape them now (arm64's TCR_EL1 no longer widens the user half for the idmap).
        regs = t.gdb.read_registers(t.machine.vcpus[0])
        paging = t.mem.paging = t.arch.page_tables(regs)
        paging.learn(t.symbols.__contains__)
        t.mem.pgd = t.mem.pgd_of(regs[t.arch.registers.page_table])
        if paging.kernel_root_symbol in t.symbols:
            t.mem.pgd = t.mem.virt_to_phys(t.symbols.address(paging.kernel_root_symbol))
        t.cmdline = read_cmdline(t.mem, t.symbols)
        t.kernel.reopen()
        journal = Journal(vm_identity(t.symbols, t.slide, t.mem), t.journal.qemu)
        journal.set_meta(**t.journal.meta)  # the scratch area's places
        for patch in t.journal.patches.values():
            journal.record(patch)
        t.journal.clear()
        t.journal = t.machine.journal = journal
        if t.qemu is not None:
            t.qemu.remove_with_vm(journal.files())


__all__ = ["INIT_EXEC", "BootProbing", "Plan"]
