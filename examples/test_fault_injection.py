"""Fault injection: make one call of a kernel function fail and check what the program saw.

A Kretprobe's ``handler`` runs when the probed function returns, before its
caller sees the return value; setting ``regs.ax`` there changes that value.
Here the second getppid() of the guest program ``workload`` returns -ENOMEM:
the program must report exactly one failure, with errno ENOMEM.

    pytest examples/test_fault_injection.py
    pytest --qprobe-image debian-cloud --qprobe-image debian-rt examples/test_fault_injection.py
"""

from __future__ import annotations

import errno

import qprobe
from qprobe import Kretprobe, KretprobeInstance, PtRegs

U64 = (1 << 64) - 1


def workload_result(output: str) -> dict[str, str]:
    """The guest program's summary line (``workload mode=getppid n=5 ... errors=1 errnos=ENOMEM:1``)."""
    line = next(x for x in output.splitlines() if x.startswith("workload "))
    return dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)


def test_second_getppid_fails_with_enomem(qprobe_target: qprobe.Target) -> None:
    returned: list[int] = []

    def only_the_workload(ri: KretprobeInstance, regs: PtRegs) -> int:
        # Non-zero leaves this call unprobed: count only the program's own calls.
        return 0 if ri.task is not None and ri.task.comm == "workload" else 1

    def fail_the_second_call(ri: KretprobeInstance, regs: PtRegs) -> None:
        returned.append(qprobe.regs_return_value(regs))
        if len(returned) == 2:
            regs.ax = -errno.ENOMEM & U64  # a system call fails by returning -errno

    rp = Kretprobe(symbol_name="__x64_sys_getppid", entry_handler=only_the_workload, handler=fail_the_second_call)
    qprobe_target.register_kretprobe(rp)
    try:
        res = workload_result(qprobe_target.run("workload getppid-fail 5").check().output)
    finally:
        qprobe_target.unregister_kretprobe(rp)

    assert res["n"] == "5"
    assert res["errors"] == "1" and res["errnos"] == "ENOMEM:1"
    assert len(returned) == 5 and len(set(returned)) == 1  # the real parent, five times
    assert res["ret"] == str(returned[-1])  # the last call was left alone
