"""Latency histogram of a system call, bpftrace style.

The bpftrace one-liner::

    kprobe:__x64_sys_read /comm == "workload"/ { @start[tid] = nsecs; }
    kretprobe:__x64_sys_read /@start[tid]/ { @usecs = hist((nsecs - @start[tid]) / 1000); delete(@start[tid]); }

as host Python: an entry Kprobe and a Kretprobe on the same function, keyed by
the guest task's pid (the kernel's tid).

The times are HOST times: when each probe stopped the VM, as seen by this
Python process.  Under TCG, and with probes that stop the vCPU and go through
the gdbstub, they measure emulation and probe overhead far more than the
kernel's own latency; they are good for comparing runs and for checking that
every call was seen, not as absolute numbers.
"""

from __future__ import annotations

import time

import qprobe
from qprobe import Kprobe, Kretprobe, KretprobeInstance, PtRegs

N = 100


def workload_result(output: str) -> dict[str, str]:
    """The guest program's summary line (``workload mode=read n=100 ... errors=0``)."""
    line = next(x for x in output.splitlines() if x.startswith("workload "))
    return dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)


def _size(n: int) -> str:
    for suffix in ("", "K", "M", "G", "T"):
        if n < 1024 or suffix == "T":
            return f"{n}{suffix}"
        n //= 1024
    raise AssertionError("unreachable")


def log2_hist(values: list[int], width: int = 52) -> str:
    """Power-of-two buckets, printed as bpftrace's hist() prints them."""
    if not values:
        return ""
    buckets: dict[int, int] = {}
    for v in values:
        b = 0 if v <= 0 else v.bit_length()  # 0 -> [0], 1 -> [1], 2..3 -> [2, 4), ...
        buckets[b] = buckets.get(b, 0) + 1
    top = max(buckets.values())
    rows = []
    for b in range(min(buckets), max(buckets) + 1):
        label = f"[{b}]" if b <= 1 else f"[{_size(1 << (b - 1))}, {_size(1 << b)})"
        count = buckets.get(b, 0)
        bar = "@" * (count * width // top)
        rows.append(f"{label:<16}{count:>8} |{bar:<{width}}|")
    return "\n".join(rows)


def test_read_latency_histogram(qprobe_target: qprobe.Target) -> None:
    target = qprobe_target
    start: dict[int, int] = {}  # guest pid -> host time of the entry, ns
    usecs: list[int] = []

    def on_entry(kp: Kprobe, regs: PtRegs) -> None:
        task = target.current_task(regs)
        if task.comm == "workload":
            start[task.pid] = time.monotonic_ns()

    def on_return(ri: KretprobeInstance, regs: PtRegs) -> None:
        t0 = start.pop(ri.task.pid, None) if ri.task is not None else None
        if t0 is not None:
            usecs.append((time.monotonic_ns() - t0) // 1000)

    entry = Kprobe(symbol_name="__x64_sys_read", pre_handler=on_entry)
    ret = Kretprobe(symbol_name="__x64_sys_read", handler=on_return)
    target.register_kprobe(entry)
    target.register_kretprobe(ret)
    try:
        res = workload_result(target.run(f"workload read {N} 4096 /dev/zero", timeout=600).check().output)
    finally:
        target.unregister_kretprobe(ret)
        target.unregister_kprobe(entry)

    print(f"\n@usecs[{target.image.name if target.image else 'read'}]:\n{log2_hist(usecs)}")
    assert res["n"] == str(N) and res["errors"] == "0"
    assert len(usecs) == N, f"{len(usecs)} read() returns seen, the program made {N} calls"
    assert not start, "an entry without its return"
