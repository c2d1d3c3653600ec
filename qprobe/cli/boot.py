"""The target a command works on, booted or attached; ``qprobe boot`` and ``qprobe attach``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from qprobe.errors import QprobeError

from .host import _check_image, _files

if TYPE_CHECKING:
    from qprobe.api import Target


def _boot(args: argparse.Namespace, at_boot: Callable[[Target], None] | None = None) -> Target:
    """The target: attached, or booted (``at_boot``: armed before the kernel's first instruction)."""
    import qprobe

    transport = getattr(args, "transport", "rsp")
    if getattr(args, "attach", None) is not None:  # an empty --attach is an error, not a reason to boot
        if getattr(args, "cmdline", ""):
            raise QprobeError("--cmdline adds to the command line of a VM qprobe boots: with --boot --attach, "
                              "--kernel-cmdline gives the whole one QEMU boots the kernel with")  # fmt: skip
        return qprobe.attach(args.attach, args.vmlinux, allow_remote=args.allow_remote, transport=transport,
                             console=getattr(args, "console", None), shell=getattr(args, "shell", None),
                             at_boot=at_boot,
                             kernel_image=getattr(args, "kernel_image", None),
                             kernel_cmdline=getattr(args, "kernel_cmdline", None))  # fmt: skip
    _check_image(args)
    return qprobe.boot(args.image, smp=args.smp, memory=args.memory, files=_files(args.file), transport=transport,
                       cmdline=getattr(args, "cmdline", ""), at_boot=at_boot,
                       tcg_thread=getattr(args, "tcg_thread", ""))  # fmt: skip


def _say_booting(args: argparse.Namespace) -> None:
    """Said before the few seconds a boot takes, as the shell does, so that a quiet terminal is not a hung one."""
    if getattr(args, "attach", None) is None and not args.quiet:
        print(f"qprobe: booting {args.image} ({args.smp} vCPUs)...", file=sys.stderr, flush=True)


def cmd_boot(args: argparse.Namespace) -> int:
    if args.detach:
        return _boot_detached(args)
    target = _boot(args)
    qemu = target.qemu
    assert qemu is not None
    for line in _booted(args, target):
        print(line)
    print("Ctrl-C stops the VM.", flush=True)
    try:
        while qemu.alive():
            time.sleep(0.5)
        print("QEMU exited", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        qemu.terminate()


def _booted(args: argparse.Namespace, target: Target) -> list[str]:
    """What a booted VM's user needs: the kernel, how to attach, where its console goes."""
    qemu = target.qemu
    assert qemu is not None
    lines = [f"booted {args.image} in {target.timings.get('boot', 0):.1f} s "
             f"(kernel slide {target.slide:#x}, {target.vcpus} vCPUs)",
             f"attach with:  qprobe attach unix:{qemu.gdb_path}",
             f"console log:  {qemu.console_log}",
             f"shell log:    {qemu.shell_log}"]  # fmt: skip
    # Release the gdbstub and the serial ports (each takes one client) so other qprobe processes can attach.
    target.machine.close(detach=True)
    target.release_serial_ports()
    return lines


def _boot_detached(args: argparse.Namespace) -> int:
    """Boot in a child process that keeps the VM (it dies with its owner) and return once it is ready.

    The child is forked before anything boots, in its own session, so the terminal's
    Ctrl-C and hang-up do not reach it; it reports through a pipe and then only waits.
    """
    _check_image(args)
    _files(args.file)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write_end)
        with os.fdopen(read_end) as report:
            text = report.read()
        sys.stdout.write(text)
        if not text.startswith("booted "):
            os.waitpid(pid, 0)
            return 2
        print(f"the VM runs in the background; stop it with:  kill {pid}", flush=True)
        return 0
    os.close(read_end)
    os.setsid()
    status = 0
    with os.fdopen(write_end, "w") as report:
        try:
            target = _boot(args)
        except QprobeError as exc:
            report.write(f"qprobe: error: {exc}\n")
            os._exit(2)
        report.write("".join(line + "\n" for line in _booted(args, target)))
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    qemu = target.qemu
    assert qemu is not None
    try:
        while qemu.alive():
            time.sleep(0.5)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        qemu.terminate()
    os._exit(status)


def cmd_attach(args: argparse.Namespace) -> int:
    """Attach, restore anything an earlier qprobe left behind, report, detach."""
    target = _boot(args)
    try:
        print(f"attached: kernel slide {target.slide:#x}, {target.vcpus} vCPUs, "
              f"restored {target.recovered} leftover patch(es)")  # fmt: skip
    finally:
        target.close()
    return 0
