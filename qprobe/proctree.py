"""The processes one guest command makes, followed as they fork: bpftrace's ``-c CMD`` and ``cpid``.

``Target.run`` has the guest's console shell fork a subshell that runs the
command; that child is the command's process (``cpid``), and every task it
or its descendants fork belongs to it too.  Forks are seen where the kernel
hands a new task to the scheduler, ``wake_up_new_task(struct task_struct *p)``
(kernel/sched/core.c; called in the parent's context by ``kernel_clone`` for
processes and threads alike), by a kprobe event that fetches ``p->pid``.
The event's handler runs while the parent is stopped at the call, before
the child can run, so a child is a member before its first hit.

The subshell itself is the launcher until it execs the command (the shell
execs a subshell's last command in place): what it does before that (the
redirections ``run`` wraps the command in) is not the command's.  Its hits count from its
exec on, as bpftrace's ``-c`` child counts from the command's first
instruction; every process it forks counts from its start.  The exec is
seen where the kernel begins it, ``begin_new_exec`` (Linux 5.9's rename of
``flush_old_exec``, called in the exec'ing task), placed among the hits by
its time.
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
EXEC_FUNCTIONS = ("begin_new_exec", "flush_old_exec")  # Linux 5.9 renamed flush_old_exec


class ProcessTree:
    """Members (task ids) of the next command ``target.run`` starts; ``on_root(cpid)`` when it forks."""

    def __init__(self, target: Target, on_root: Callable[[int], None] | None = None) -> None:
        self.target = target
        self.on_root = on_root
        self.cpid: int | None = None
        self.members: set[int] = set()  # forked by the command's process or its descendants
        self.exec_order: float | None = None  # when the root exec'd the command (a hit's order)
        self._lock = threading.Lock()
        try:
            pid_offset = offsetof(target.prog.type("struct task_struct"), "pid")
        except (LookupError, QprobeError) as exc:
            raise QprobeError(f"cannot follow the command's processes: no struct task_struct ({exc})") from None
        # $$ is the console shell's pid in its subshells too (POSIX), so this is the command's parent.
        self.shell = int(target.run("echo $$").check().output.split()[-1])
        self.event: TraceEvent = target.add_event(
            f"p:qprobe_cpid/fork {FORK_FUNCTION} child=+{pid_offset}(%di):s32", self._fork
        )
        exec_function = next((f for f in EXEC_FUNCTIONS if f in target.symbols), None)
        if exec_function is None:
            target.remove_event(self.event)
            raise QprobeError(
                f"cannot follow the command's processes: the kernel has none of {', '.join(EXEC_FUNCTIONS)}"
            )
        self.exec_event: TraceEvent = target.add_event(f"p:qprobe_cpid/exec {exec_function}", self._exec)

    def _fork(self, hit: EventHit) -> None:
        parent, child = hit.pid, int(hit.args["child"])
        with self._lock:
            if self.cpid is None and parent == self.shell:
                self.cpid = child
            elif parent not in self.members:
                return
            self.members.add(child)
        if child == self.cpid and self.on_root is not None:
            self.on_root(child)

    def _exec(self, hit: EventHit) -> None:
        with self._lock:
            if hit.pid == self.cpid and self.exec_order is None:
                self.exec_order = hit.order

    def owns(self, hit: EventHit) -> bool:
        """Whether ``hit`` is the command's: of a process it forked, or of its own process once it exec'd."""
        with self._lock:
            if hit.pid != self.cpid:
                return hit.pid in self.members
            return self.exec_order is not None and hit.order >= self.exec_order

    def close(self) -> None:
        self.target.remove_events([self.event, self.exec_event])
