"""A kernel function is reached with the arguments the program passed.

``workload lseek N`` calls ``lseek(fd, i, SEEK_SET)`` for i = 1..N; each
reaches ``ksys_lseek(fd, offset, whence)``.  Two ways to look:

- a kprobe_events definition, as you would write it for the guest's
  /sys/kernel/tracing/kprobe_events (but evaluated on the host: the guest
  needs no tracing support), whose hits carry formatted arguments;
- a Kprobe whose pre_handler reads the argument registers itself.
"""

from __future__ import annotations

import os

import qprobe
from qprobe import Kprobe, PtRegs, regs_get_kernel_argument

N = 20


def workload_result(output: str) -> dict[str, str]:
    """The guest program's summary line (``workload mode=lseek n=20 pid=.. fd=3 ...``)."""
    line = next(x for x in output.splitlines() if x.startswith("workload "))
    return dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)


def test_lseek_arguments_through_kprobe_events(qprobe_target: qprobe.Target) -> None:
    event = qprobe_target.add_event("p:lseekargs ksys_lseek fd=%di:s32 off=%si:s64 whence=%dx:u32")
    try:
        res = workload_result(qprobe_target.run(f"workload lseek {N}").check().output)
    finally:
        qprobe_target.remove_event(event)

    hits = [h for h in event.hits if h.pid == int(res["pid"])]
    assert [h.args for h in hits] == [{"fd": res["fd"], "off": str(i), "whence": str(os.SEEK_SET)}
                                      for i in range(1, N + 1)]  # fmt: skip
    assert all(h.comm == "workload" for h in hits)
    print("\n".join(h.line() for h in hits[:3]))  # ftrace's format: shown with pytest -s


def test_lseek_arguments_through_a_pre_handler(qprobe_target: qprobe.Target) -> None:
    seen: list[tuple[int, int, int]] = []

    def record(kp: Kprobe, regs: PtRegs) -> None:
        if qprobe_target.current_task(regs).comm == "workload":
            fd, offset, whence = (regs_get_kernel_argument(regs, n) for n in range(3))
            seen.append((fd, offset, whence))

    kp = Kprobe(symbol_name="ksys_lseek", pre_handler=record)
    qprobe_target.register_kprobe(kp)
    try:
        res = workload_result(qprobe_target.run(f"workload lseek {N}").check().output)
    finally:
        qprobe_target.unregister_kprobe(kp)

    assert seen == [(int(res["fd"]), i, os.SEEK_SET) for i in range(1, N + 1)]
