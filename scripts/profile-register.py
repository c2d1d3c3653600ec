"""Where registering a batch of counting probes spends its time, for docs/performance.md.

Boots the default image (smp 2) and registers N counting probes (no handler:
jump-optimized, counted in the guest) in one batch on the functions
``qprobe bench --sections scale`` uses (the fork-heavy loop's, the guest's
kprobe_events accepts them and qprobe optimizes them), twice.  For each
batch: the register time, the optimizer's wait after it, every VM stop
register asked for and every optimizer round (its points, those left and
why), then the stop-loop thread's cProfile (cumulative, top 30), where
every guest write, gdbstub round trip and check runs.

    PYTHONPATH=. .venv/bin/python scripts/profile-register.py [N]
"""

from __future__ import annotations

import collections
import cProfile
import io
import pstats
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import qprobe
from qprobe.bench.common import WORKLOADS, _wait_for_optimizer
from qprobe.bench.scale import _optimizable, reached_functions


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    with qprobe.boot("debian-cloud", smp=2, memory="512M") as target:
        cmd = WORKLOADS[0][2]
        names = _optimizable(target, reached_functions(target, cmd.format(n=1)), n)
        km, machine = target.kprobes, target.machine
        opt = km.optimizer
        t0 = [0.0]
        log: list[str] = []
        call, optimize_queued = machine.call, opt.queue._optimize_queued

        def timed_call(fn: Callable[[], Any], timeout: float | None = 60.0) -> Any:
            start = time.perf_counter()
            try:
                return call(fn, timeout)
            finally:
                log.append(f"  stop  at {start - t0[0]:6.3f} s, {time.perf_counter() - start:6.3f} s: "
                           f"{getattr(fn, '__name__', '?')} ({threading.current_thread().name})")  # fmt: skip

        def timed_round() -> list[int]:
            start, queued = time.perf_counter(), len(opt.queue.optimizing_list)
            left = optimize_queued()
            why = collections.Counter((km.points[a].not_optimized or "?")[:70] for a in left if a in km.points)
            log.append(f"  round at {start - t0[0]:6.3f} s, {time.perf_counter() - start:6.3f} s: {queued} queued, "
                       f"{len(left)} left {dict(why.most_common(3))}")  # fmt: skip
            return left

        machine.call = timed_call  # type: ignore[method-assign]
        opt.queue._optimize_queued = timed_round  # type: ignore[method-assign]
        for batch in (1, 2):
            kps = [qprobe.Kprobe(symbol_name=name) for name in names]
            prof = cProfile.Profile()
            call(prof.enable)  # the stop-loop thread's own profile
            log.clear()
            t0[0] = time.perf_counter()
            target.register_kprobes(kps)
            registered = time.perf_counter() - t0[0]
            waited = _wait_for_optimizer(target)
            call(prof.disable)
            optimized = sum(km.points[kp.resolved].opt is not None for kp in kps)
            print(f"batch {batch}: {len(kps)} probes registered in {registered:.2f} s, the optimizer "
                  f"{waited:.2f} s after, {optimized} optimized")  # fmt: skip
            print("\n".join(log))
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
            print(out.getvalue())
            target.unregister_kprobes(kps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
