"""Where preempted kernel contexts could resume: the live words on the stacks of tasks that are not running.

On a fully preemptible kernel a task can be preempted anywhere interrupts are
on, and sleep there for as long as the scheduler likes; its saved ip (in the
pt_regs of the interrupt that preempted it) and the return addresses of its
callers stay on its kernel stack.  Before placing a jump over instructions,
and before giving up code a context may still be in, the kernel waits for
an RCU-tasks grace period: ``synchronize_rcu_tasks()`` in kprobe_optimizer()
(kernel/kprobes.c, step 2 as of Linux 6.1; since commit a30b85df7d59,
"kprobes: Use synchronize_rcu_tasks() for optprobe with CONFIG_PREEMPT=y"),
i.e. until every task has passed through a voluntary context switch.  The
host sees all of guest RAM with the VM stopped, so it looks instead: every
8-byte word from a sleeping task's saved stack pointer (``thread.sp``, where
``__switch_to_asm`` left it) to the top of its stack that points into a
region means a context might resume there.  Stale words only delay.
"""

from __future__ import annotations

import bisect
import struct
import time
from collections.abc import Callable, Sequence

import drgn
from drgn.helpers.linux.cpumask import for_each_online_cpu
from drgn.helpers.linux.pid import for_each_task

from qprobe.errors import QprobeError
from qprobe.kernel.program import KernelData

# Seconds qprobe waits, when it gives up its scratch area (remove_all, recovery), for tasks preempted
# in the area to leave it; past that the area stays mapped, with the undo journal.
PREEMPTED_WAIT = 10.0


def wait_preempted_out(held: Callable[[], str | None], let_run: Callable[[], None]) -> str | None:
    """Before an area is given up: until ``held()`` (VM stopped) finds nothing that could resume there,
    ``let_run()`` lets the guest run so that preempted tasks get the CPU and leave it.

    None once nothing is held; else what still was after ``PREEMPTED_WAIT``
    seconds, and the caller keeps the area mapped, with the undo journal.
    """
    deadline = time.monotonic() + PREEMPTED_WAIT
    while (now := held()) is not None:
        if time.monotonic() > deadline:
            return now
        let_run()
    return None


def live_span(stack: int, sp: int, size: int) -> tuple[int, int]:
    """[lo, hi) of a sleeping task's stack that is in use: from its saved sp, or the whole stack if sp is elsewhere."""
    top = stack + size
    lo = sp & ~7 if stack <= sp < top else stack
    return lo, top


def words_of(data: bytes) -> list[int]:
    """The little-endian 8-byte words of ``data`` (a trailing partial word is dropped)."""
    return list(struct.unpack(f"<{len(data) // 8}Q", data[: len(data) // 8 * 8]))


def first_inside(words: Sequence[int], lo: int, hi: int) -> int | None:
    """The smallest of the sorted ``words`` in [lo, hi), or None."""
    i = bisect.bisect_left(words, lo)
    return words[i] if i < len(words) and words[i] < hi else None


def running_tasks(kernel: KernelData) -> set[int]:
    """The address of each online CPU's ``current`` task (the per-CPU ``RegisterLayout.current_percpu``, which
    ``__switch_to`` sets: x86's ``current_task``, arm64's ``__entry_task``)."""
    prog = kernel.prog
    offsets = prog["__per_cpu_offset"]
    return {
        drgn.Object(prog, "unsigned long", address=offsets[cpu].value_() + kernel.current_task_offset).value_()
        for cpu in for_each_online_cpu(prog)
    }


def preempted_words(kernel: KernelData, stack_size: int) -> list[int]:
    """Sorted live stack words of every task that is not some CPU's ``current``.

    A current task's context is the vCPU's registers and stack, which the
    callers check themselves.  Raises QprobeError if a task's stack cannot be
    read: the caller cannot tell, so it must not go on.
    """
    words: set[int] = set()
    try:
        running = running_tasks(kernel)
        for task in for_each_task(kernel.prog):
            if task.value_() in running:
                continue  # its live stack is the vCPU's: the caller checks that from the registers
            stack = task.stack.value_()
            if not stack:
                continue  # exited: its stack is already freed, no context is left on it
            lo, hi = live_span(stack, task.thread.sp.value_(), stack_size)
            words.update(words_of(kernel.mem.read(lo, hi - lo)))
    except (drgn.FaultError, LookupError) as exc:
        raise QprobeError(f"the task list cannot be read: {exc}") from None
    return sorted(words)


__all__ = [
    "PREEMPTED_WAIT",
    "first_inside",
    "live_span",
    "preempted_words",
    "running_tasks",
    "wait_preempted_out",
    "words_of",
]
