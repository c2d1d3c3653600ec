"""The processes one guest command makes, followed as they fork: bpftrace's ``-c CMD`` and ``cpid``.

``Target.run`` has the guest's console shell run a command as ``( ( CMD ); exit ) <redirections>``:
the shell forks a launcher (the outer subshell), which takes the redirections and forks the
command's process (the inner subshell, ``cpid``), which runs CMD itself.  CMD's process is a member
from its fork on, every task it or its descendants fork from theirs, whether or not any of them
execs: a busybox applet (a standalone or NOFORK applet runs in the shell's process without an
exec), a builtin and a pipeline are CMD's as much as a program is.  The launcher's own work (the
redirections, and the job control a top-level subshell does: its process group, the terminal's
foreground group, its signals) is not CMD's, and the console shell's (reading the line, printing
the markers) is not either; the inner subshell does none of that before CMD, being a subshell of a
subshell with no redirections of its own.

Forks are seen where the kernel hands a new task to the scheduler, ``wake_up_new_task(struct
task_struct *p)`` (kernel/sched/core.c; called in the parent's context by ``kernel_clone`` for
processes and threads alike), by a kprobe event that fetches ``p->pid``.  The event's handler runs
while the parent is stopped at the call, before the child can run, so a child is a member before
its first hit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from drgn import offsetof

from qprobe.errors import QprobeError

if TYPE_CHECKING:
    from qprobe.api import Target
    from qprobe.events import EventHit, TraceEvent

__all__ = ["ProcessTree"]

FORK_FUNCTION = "wake_up_new_task"


class ProcessTree:
    """Members (task ids) of the next command ``target.run`` starts; ``on_root(cpid)`` when it forks."""

    def __init__(self, target: Target, on_root: Callable[[int], None] | None = None) -> None:
        self.target = target
        self.on_root = on_root
        self.launcher: int | None = None  # the shell's child that forks the command's process
        self.cpid: int | None = None
        self.members: set[int] = set()  # the command's process and what it and its descendants forked
        self._lock = threading.Lock()
        try:
            pid_offset = offsetof(target.prog.type("struct task_struct"), "pid")
        except (LookupError, QprobeError) as exc:
            raise QprobeError(f"cannot follow the command's processes: no struct task_struct ({exc})") from None
        # $$ is the console shell's pid in its subshells too (POSIX), so this is the launcher's parent.
        self.shell = int(target.run("echo $$").check().output.split()[-1])
        task = target.arch.registers.arg_regs[0]  # at its entry: the new task, its one argument
        self.event: TraceEvent = target.add_event(
            f"p:qprobe_cpid/fork {FORK_FUNCTION} child=+{pid_offset}(%{task}):s32", self._fork
        )

    def _fork(self, hit: EventHit) -> None:
        parent, child = hit.pid, int(hit.args["child"])
        with self._lock:
            if self.launcher is None:
                if parent == self.shell:
                    self.launcher = child
                return
            if self.cpid is None and parent == self.launcher:
                self.cpid = child
            elif parent not in self.members:
                return
            self.members.add(child)
        if child == self.cpid and self.on_root is not None:
            self.on_root(child)

    def owns(self, hit: EventHit) -> bool:
        """Whether ``hit`` is the command's: of its process or one its process tree forked."""
        return self.owns_pid(hit.pid)

    def owns_pid(self, pid: int) -> bool:
        """Whether task ``pid`` is the command's (a pid reused after a member exited stays a member)."""
        with self._lock:
            return pid in self.members

    def close(self) -> None:
        self.target.remove_event(self.event)
