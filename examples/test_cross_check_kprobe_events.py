"""Cross-check qprobe with the guest kernel's own kprobes.

The guest counts the calls of ``__x64_sys_getppid`` with a kprobe_events
probe (its own kprobes: the events its filter keeps in /sys/kernel/tracing/trace,
its misses in kprobe_profile); qprobe counts them from the host.  Both must
equal the number of calls the program made.

Both count the program's calls only (``/comm == "workload"/`` in bpftrace's
words), as the guest is not quiet on every image: on a buildroot image the
image's own rcS scripts go on running beside the test, and BusyBox's ash calls
getppid() as each one starts.

The two cannot share an instruction.  The guest kernel patches its probe
point - with an int3, or, at a function's ``__fentry__`` call site on a kernel
with CONFIG_KPROBES_ON_FTRACE (Debian's), by turning that 5-byte nop into a
call to an ftrace trampoline - and qprobe refuses to put its int3 on bytes
someone else patched (``ProbeBusy``): each would restore the other's bytes.
So the guest probes the function entry and qprobe the next instruction.

Order matters for the plugin's check that the function's text is the same
after the test: qprobe arms before the guest's probe is enabled and disarms
after it is disabled, so qprobe's snapshot and the final text both have the
plain nop.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import qprobe
from qprobe import Kprobe, PtRegs

TRACING = "/sys/kernel/tracing"  # mounted by the guest's /init
FUNC = "__x64_sys_getppid"
EVENT = "guestgp"
N = 50
ENDBR64 = bytes.fromhex("f30f1efa")
NOP5 = bytes.fromhex("0f1f440000")  # what ftrace leaves at the __fentry__ call site


def workload_result(output: str) -> dict[str, str]:
    """The guest program's summary line (``workload mode=getppid n=50 ... errors=0``)."""
    line = next(x for x in output.splitlines() if x.startswith("workload "))
    return dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)


def after_fentry(target: qprobe.Target, func: str) -> int:
    """Offset of the instruction after ``func``'s __fentry__ call site (after an endbr64 with IBT)."""
    code = target.read(func, 16)
    site = len(ENDBR64) if code.startswith(ENDBR64) else 0
    if code[site : site + 5] != NOP5 and code[site] != 0xE8:  # e8: the site is a call while traced
        pytest.skip(f"{func} does not start with an __fentry__ call site: {code.hex()}")
    return site + 5


def missed(target: qprobe.Target, event: str) -> int:
    """The misses of a guest kprobe event, from kprobe_profile."""
    for line in target.run(f"cat {TRACING}/kprobe_profile").check().output.splitlines():
        fields = line.split()
        if fields and fields[0] == event:
            return int(fields[2])
    raise AssertionError(f"{event} is not in the guest's kprobe_profile")


def traced(target: qprobe.Target, event: str) -> int:
    """How many of the event's records the guest's trace buffer holds."""
    return sum(f" {event}: " in line for line in target.run(f"cat {TRACING}/trace").check().output.splitlines())


@pytest.fixture
def guest_event(qprobe_target: qprobe.Target) -> Iterator[str]:
    """A guest kprobe event on FUNC's entry that keeps the workload's hits, defined (not yet
    enabled), with an empty trace buffer; removed afterwards."""
    qprobe_target.run(f"echo 'p:{EVENT} {FUNC}' >> {TRACING}/kprobe_events && "
                      f"echo 'comm == \"workload\"' > {TRACING}/events/kprobes/{EVENT}/filter && "
                      f"echo > {TRACING}/trace").check()  # fmt: skip
    try:
        yield f"{TRACING}/events/kprobes/{EVENT}/enable"
    finally:
        qprobe_target.run(f"echo 0 > {TRACING}/events/kprobes/{EVENT}/enable; "
                          f"echo '-:{EVENT}' >> {TRACING}/kprobe_events").check()  # fmt: skip


@pytest.mark.qprobe_needs_config("KPROBE_EVENTS")
@pytest.mark.qprobe_needs_config("FUNCTION_TRACER")
def test_qprobe_and_the_guest_count_the_same_calls(qprobe_target: qprobe.Target, guest_event: str) -> None:
    target = qprobe_target
    calls = 0

    def count(kp: Kprobe, regs: PtRegs) -> None:
        nonlocal calls
        calls += target.current_task(regs).comm == "workload"

    kp = Kprobe(symbol_name=FUNC, offset=after_fentry(target, FUNC), pre_handler=count)
    target.register_kprobe(kp)
    try:
        target.run(f"echo 1 > {guest_event}").check()
        res = workload_result(target.run(f"workload getppid {N}").check().output)
        target.run(f"echo 0 > {guest_event}").check()
    finally:
        target.unregister_kprobe(kp)

    assert res["n"] == str(N) and res["errors"] == "0"
    assert (calls, kp.nmissed) == (N, 0)
    guest = (traced(target, EVENT), missed(target, EVENT))
    assert guest == (N, 0), f"the guest's own kprobe kept {guest[0]} of the workload's calls and missed {guest[1]}"
