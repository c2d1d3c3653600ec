"""The interactive commands on a live guest: ``qprobe shell`` and ``qprobe drgn``."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from qprobe.errors import QprobeError

from .boot import _boot, _say_booting
from .definitions import _arm, _check_boot, _check_symbols, _parse_definitions, _perf_definitions
from .host import _check_image, _need_dwarf

if TYPE_CHECKING:
    from qprobe.api import Target
    from qprobe.events import TraceEvent


def cmd_shell(args: argparse.Namespace) -> int:
    """The interactive shell on a booted (or attached) target; every probe is removed on the way out.

    EVENTs are checked before anything boots.  With ``--boot`` they are armed before the kernel's first
    instruction (stub breakpoints, as ``trace --boot``), so that the prompt finds them as events of the
    shell, their hits since start_kernel counted; without it they are the shell's first commands.
    """
    from qprobe.fetch import ProbeEvent
    from qprobe.shell import Shell, run_shell

    if args.boot and not args.events:
        raise QprobeError("--boot arms the EVENTs given after it before the kernel runs: give at least one, "
                          "e.g. 'p:sk start_kernel'")  # fmt: skip
    _check_image(args)
    _check_boot(args)
    _perf_definitions(args)
    definitions, checked = _parse_definitions(args)
    _check_symbols(args, [ev for ev in checked if isinstance(ev, ProbeEvent)])
    _say_booting(args)
    at_boot: list[TraceEvent] = []
    armed_at: list[float] = []

    def arm_at_boot(target: Target) -> None:  # before the kernel's first instruction: stub breakpoints
        at_boot.extend(te for d in definitions for te in _arm(target, d))  # the int3 path once booted
        armed_at.append(time.monotonic())

    with _boot(args, arm_at_boot if args.boot else None) as target:
        shell = Shell(target)
        for te in at_boot:
            shell.armed[te.name] = armed_at[0]  # stats' hits/s since the events were armed, not since the prompt
        if not args.boot:
            for text in args.events:
                shell.execute(text)
        return run_shell(target, shell)


def cmd_drgn(args: argparse.Namespace) -> int:
    """drgn's interactive mode on a booted (or attached) guest, EVENTs armed while it runs."""
    from qprobe.shell.inspect_cmds import drgn_session

    _check_image(args)
    _need_dwarf(args, "qprobe drgn (the kernel's types and variables)")
    _say_booting(args)
    with _boot(args) as target:
        for definition in args.events:
            target.add_event(definition)
        drgn_session(target)
    return 0
