"""The shell's guest commands: ``run CMD``, and the watch that ``show`` and the maps keep for a while,
until Ctrl-C or while a command runs in the guest."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from qprobe.errors import QprobeError

from .parse import ShellUsageError

if TYPE_CHECKING:
    from qprobe.vmm.console import RunResult

    from .context import Handler, ShellContext
    from .parse import Collect

RUN_TIMEOUT = 3600.0


class GuestCommands:
    """Commands run in the guest, with their output and exit status, and Ctrl-C passed on to them."""

    def __init__(self, shell: ShellContext) -> None:
        self.shell = shell

    def handlers(self) -> dict[str, Handler]:
        return {"run": self.cmd_run}

    def cmd_run(self, rest: str) -> None:
        if not rest:
            raise ShellUsageError("usage: run CMD")
        try:
            result = self.shell.target.run(rest, timeout=RUN_TIMEOUT)
        except KeyboardInterrupt:
            self.interrupt_guest()
            self.shell.out.line("")
            self.shell.note("interrupted: sent ^C to the guest command")
            return
        self.print_run(result)

    def print_run(self, result: RunResult) -> None:
        if result.output:
            self.shell.out.write(result.output if result.output.endswith("\n") else result.output + "\n")
        self.shell.out.line(f"exit status {result.status}", "note" if result.status == 0 else "error")

    def watch(self, spec: Collect, poll: Callable[[], None], ready: str) -> RunResult | QprobeError | None:
        """Until Ctrl-C, for ``spec.seconds``, or while ``spec.command`` runs in the guest.

        A watch until Ctrl-C prints ``ready`` (which says so) once a Ctrl-C ends the watch:
        one typed as soon as it shows must not interrupt the set-up before it instead.
        ``poll`` (printing hits, for ``show``) runs every 0.1 s.  The guest command
        runs on this thread, so that Ctrl-C interrupts its wait and frees the console
        at once (and is passed on to the guest); ``poll`` then runs on a helper thread.
        Returns the command's result, or the error it raised.
        """
        if spec.command is not None:
            stop = threading.Event()

            def poller() -> None:
                while not stop.wait(0.1):
                    poll()

            helper = threading.Thread(target=poller, name="qprobe-shell-poll", daemon=True)
            helper.start()
            result: RunResult | QprobeError | None = None
            try:
                result = self.shell.target.run(spec.command, timeout=RUN_TIMEOUT)
            except KeyboardInterrupt:
                self.interrupt_guest()
                # run() drains the record rings when the command ends; an interrupted one did not.
                self.shell.target.sync()
                self.shell.out.line("")
                self.shell.note("interrupted: sent ^C to the guest command")
            except QprobeError as exc:
                result = exc
            finally:
                stop.set()
                helper.join()
            poll()
            return result
        deadline = None if spec.seconds is None else time.monotonic() + spec.seconds
        try:
            if deadline is None:
                self.shell.note(ready)
            while True:
                poll()
                left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
                if left <= 0:
                    break
                self.shell.target.wait(left)  # a VM that dies ends the watch at once
        except KeyboardInterrupt:
            self.shell.out.line("")
        # The hits still in the guest's record rings when the count ends (time up or Ctrl-C).
        self.shell.target.sync()
        poll()
        return None

    def report_run(self, result: RunResult | QprobeError | None) -> None:
        if isinstance(result, QprobeError):
            self.shell.error(str(result))
        elif result is not None:
            self.print_run(result)

    def interrupt_guest(self) -> None:
        """Ctrl-C the guest's foreground command (the guest shell's port is its controlling tty)."""
        try:
            self.shell.target.interrupt_guest()
        except QprobeError:
            pass


__all__ = ["RUN_TIMEOUT", "GuestCommands"]
