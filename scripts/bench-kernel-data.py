"""The kernel-data layer's cost, for docs/performance.md: attach, memory, µs per stack trace in a handler.

Boots the default image, then: attach time (boot excluded), the process's
resident memory after attach and once the kernel-data layer is loaded
(``Target.prog``, where the checkout has one), and the time of
``regs.stack_trace()`` in a pre_handler on ``__x64_sys_getppid`` over 1,000
hits (median and 90th percentile).  Runs against whichever qprobe is first on
``sys.path``, so an older checkout is measured with ``PYTHONPATH=that/tree``.
"""

from __future__ import annotations

import statistics
import time

import qprobe
from qprobe import Kprobe

HITS = 1000


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    print(f"qprobe from {qprobe.__file__}")
    with qprobe.boot("debian-cloud", smp=2) as t:
        print(f"attach (boot excluded): {t.timings['attach'] - t.timings['boot']:.2f} s; rss {rss_mb():.0f} MB")
        start = time.perf_counter()
        if hasattr(t, "prog"):
            t.prog  # noqa: B018 - created on first use: this is what is timed
        print(f"kernel data layer loaded in {time.perf_counter() - start:.3f} s more; rss {rss_mb():.0f} MB")
        times: list[float] = []

        def pre(kp: Kprobe, regs: qprobe.PtRegs) -> None:
            start = time.perf_counter()
            regs.stack_trace()
            times.append(time.perf_counter() - start)

        kp = Kprobe(symbol_name="__x64_sys_getppid", pre_handler=pre)
        t.register_kprobe(kp)
        t.run(f"workload getppid {HITS}", timeout=900).check()
        t.unregister_kprobe(kp)
        times.sort()
        print(f"stack traces: {len(times)}, median {statistics.median(times) * 1e6:.0f} µs, "
              f"p90 {times[int(len(times) * 0.9)] * 1e6:.0f} µs; rss {rss_mb():.0f} MB")  # fmt: skip


if __name__ == "__main__":
    main()
