"""The delayed optimizer: the kernel's optimizing_list and its kprobe_optimizer work, in steps and on a thread.

A point is armed with an int3 first; after a grace period one VM stop places
the jump of every queued point that can take it (qprobe.core.optimizer);
what a vCPU is still passing through stays queued and the optimizer thread
tries again later, less often each round.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from qprobe.core.errorlog import ErrorLog
from qprobe.core.optcheck import RESUME_GRACE, JumpCheck, transient
from qprobe.core.point import ProbePoint
from qprobe.errors import QprobeError, TargetGone

if TYPE_CHECKING:
    from qprobe.vmm.machine import Machine
    from qprobe.vmm.scratch import ScratchArea

OPTIMIZE_DELAY = 0.05  # seconds the VM runs between arming the int3 and placing the jump
OPTIMIZE_RETRIES = 5  # attempts before register returns, for a probe a vCPU was passing through
OPTIMIZE_MAX_DELAY = 1.0  # seconds between the optimizer thread's later attempts, at most


class OptimizingQueue:
    """Points waiting for their jump, and the work that places them (``optimize``, on the stop loop)."""

    def __init__(self, machine: Machine, points: dict[int, ProbePoint], scratch: ScratchArea, check: JumpCheck,
                 optimize: Callable[[ProbePoint], bool], enabled: Callable[[], bool],
                 errors: ErrorLog) -> None:  # fmt: skip
        self.machine = machine
        self.points = points
        self.scratch = scratch
        self.check = check
        self.optimize = optimize
        self.enabled = enabled  # debug.kprobes_optimization, read at each call
        self.errors = errors
        # Addresses waiting for their jump, with when they were queued (the kernel's optimizing_list);
        # changed on the stop loop only.
        self.optimizing_list: dict[int, float] = {}
        self._thread: threading.Thread | None = None  # later rounds of the optimizing list
        self._kick = threading.Event()
        self._stop = False

    def optimize_later(self, addrs: Iterable[int]) -> None:
        """Queue points for the jump and work the queue: optimize_kprobe() and kprobe_optimizer().

        Unoptimizing needs no queue here: the stop loop swaps a jump back for
        the int3 while every vCPU is stopped (``Optimizer.unoptimize``), and the detour
        is quarantined instead of freed after a quiescent period.
        """
        queued = list(addrs)
        if self.enabled() and queued and self.machine.call(lambda: self.enqueue(queued)):
            self.kprobe_optimizer(queued)

    def kprobe_optimizer(self, mine: list[int]) -> None:
        """Work the optimizing list in steps, as kernel/kprobes.c's kprobe_optimizer() does, until ``mine`` is done."""
        # Step 1: the queued points are int3s whose hits are single-stepped, not boosted (enqueue).
        # Step 2: a grace period, so that no context is left inside one of their boosted copies on
        # its way back into a region (the kernel's synchronize_rcu_tasks()).
        time.sleep(max(OPTIMIZE_DELAY, RESUME_GRACE))
        for _ in range(OPTIMIZE_RETRIES):
            # Step 3: in one VM stop, place the jump of every queued point that can take it now.
            left = self.machine.call(self._optimize_queued)
            if not any(a in left for a in mine):
                return
            # Step 4: a vCPU inside a region (or a context interrupted there) only delays its
            # jump: the optimizer runs again after a short delay (the kernel's kick_kprobe_optimizer).
            time.sleep(OPTIMIZE_DELAY)
        # Step 5: what is still held up stays queued, a plain int3 meanwhile, and the optimizer
        # thread works the list later, less often each round, until it is empty: kprobe_optimizer()
        # kicks itself again while its optimizing_list is not empty (kernel/kprobes.c).
        self._kick_optimizer()

    def _kick_optimizer(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._optimizer_loop, name="qprobe-optimizer", daemon=True)
            self._thread.start()
        self._kick.set()

    def _optimizer_loop(self) -> None:
        """The optimizer thread: a round every ``delay`` s while the list holds points, else asleep until kicked."""
        delay = OPTIMIZE_DELAY
        while not self._stop:
            # Read off the stop loop: a stale answer costs one round or one kick's wait.
            if self._kick.wait(delay if self.optimizing_list else None):
                self._kick.clear()
                delay = OPTIMIZE_DELAY  # newly queued: their own grace period first
                continue
            if self._stop:
                return
            try:
                left = self.machine.call(self._optimize_queued)
            except TargetGone:
                return
            except QprobeError as exc:
                self.errors.add(f"optimizer: {exc}")
                left = list(self.optimizing_list)
            delay = min(max(delay, OPTIMIZE_DELAY) * 2, OPTIMIZE_MAX_DELAY) if left else OPTIMIZE_DELAY

    def enqueue(self, addrs: list[int]) -> bool:
        """optimize_kprobe(): queue points for the jump (stop loop); False if nothing is (the knob is off)."""
        if not self.enabled() or not addrs:
            return False
        for a in addrs:
            point = self.points.get(a)
            if point is not None:
                point.optimizing = True
                self.optimizing_list.setdefault(a, time.monotonic())
        return True

    def _optimize_queued(self) -> list[int]:
        """Optimize what has been queued a grace period; the list keeps what a later attempt may still optimize."""
        now, grace = time.monotonic(), max(OPTIMIZE_DELAY, RESUME_GRACE)
        self.check.begin_round()
        # Every jump of the round journaled in one write, the detours written in as few as can be.
        with self.machine.journal.batch(), self.scratch.combined():
            try:
                self._optimize_round(now, grace)
            finally:
                self.check.round = None
        return list(self.optimizing_list)

    def _optimize_round(self, now: float, grace: float) -> None:
        """One round's attempts, in the VM stop of ``_optimize_queued``."""
        for a, since in list(self.optimizing_list.items()):
            if now - since < grace:
                continue  # queued by another caller since: its own grace period is not over
            point = self.points.get(a)
            if (
                point is None
                or point.opt is not None
                or not point.armed
                or self.optimize(point)
                or point.not_optimized is None
                or not transient(point.not_optimized)
            ):
                del self.optimizing_list[a]
                if point is not None:
                    point.optimizing = False  # boosted again, if it stays an int3

    def close(self) -> None:
        """Stop the thread (not joined: it may be waiting for this very stop loop)."""
        self._stop = True
        self.optimizing_list.clear()
        self._kick.set()
