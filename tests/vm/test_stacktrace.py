"""Host-side ORC stack traces of the real default image, checked against the guest kernel's own unwinder.

The guest is the reference twice over: its ftrace kprobe events print the
stack from a probe's registers (``options/stacktrace``), and
``/proc/PID/stack`` prints a sleeping task's.  Both go through the kernel's
ORC unwinder and kallsyms, so the host's lines must equal theirs character
for character, offsets and sizes included.
"""

from __future__ import annotations

import pytest

import qprobe
from qprobe import Kprobe, Kretprobe
from qprobe.kernel.orc import OrcUnwinder, format_stack

from .conftest import workload_result

pytestmark = pytest.mark.vm

TRACING = "/sys/kernel/tracing"
EVENT = "qprobe_orc/lseek"


def _stack_lines(output: str) -> list[str]:
    return [line.strip() for line in output.splitlines() if line.startswith("[<0>] ")]


def _in_sched_functions(target: qprobe.Target, addr: int) -> bool:
    """The kernel's in_sched_functions(): /proc/PID/stack leaves these frames out (the sleep itself)."""
    ranges = [("__sched_text_start", "__sched_text_end"), ("__lock_text_start", "__lock_text_end")]
    return any(target.symbols.address(lo) <= addr < target.symbols.address(hi) for lo, hi in ranges
               if lo in target.symbols and hi in target.symbols)  # fmt: skip


def _as_proc_stack(target: qprobe.Target, addrs: list[int]) -> list[str]:
    """Our trace as /proc/PID/stack would print it for the same task: formatted, sched frames dropped."""
    lines = format_stack(addrs, target.symbols)
    return [line for addr, line in zip(addrs, lines, strict=True) if not _in_sched_functions(target, addr)]


def _guest_lseek_trace_on(target: qprobe.Target) -> None:
    target.run(
        f"cd {TRACING} && echo 'p:{EVENT} __x64_sys_lseek' >> kprobe_events && echo 1 > options/sym-offset "
        f"&& echo 1 > options/stacktrace && echo > trace && echo 1 > events/{EVENT}/enable"
    ).check()


def _guest_lseek_trace_off(target: qprobe.Target) -> str:
    """Disarm the guest's own probe and return its trace."""
    return target.run(
        f"cd {TRACING}; echo 0 > events/{EVENT}/enable; echo 0 > options/stacktrace; cat trace; "
        f"echo '-:{EVENT}' >> kprobe_events; echo 0 > options/sym-offset; echo > trace"
    ).output


def _ftrace_stacks(trace: str, task: str) -> list[list[str]]:
    """The ``<stack trace>`` blocks of one task in an ftrace text trace: [' => sym+0x../0x..', ...] each."""
    stacks: list[list[str]] = []
    current: list[str] | None = None
    for line in trace.splitlines():
        if line.startswith(" => ") and current is not None:
            current.append(line[4:].strip())
            continue
        current = None
        if "<stack trace>" in line and line.strip().startswith(task):
            current = []
            stacks.append(current)
    return stacks


def _call_target(target: qprobe.Target, ret: int) -> int:
    """The callee of the direct ``call rel32`` that ``ret`` returns from (failing if there is none)."""
    insn = target.read(ret - 5, 5)
    assert insn[0] == 0xE8, f"no direct call before {target.symbols.symbolize(ret)}: {insn.hex()}"
    return ret + int.from_bytes(insn[1:], "little", signed=True)


def test_lseek_stack_matches_the_guest_s_own(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    unwinder = OrcUnwinder(target.symbols)
    fix = target.kretprobes.fix_return
    traces: list[tuple[int, list[int]]] = []

    def pre(kp: Kprobe, regs: qprobe.PtRegs) -> int:
        task = target.current_task(regs)
        if task.comm == "workload":
            traces.append((task.pid, unwinder.unwind({**regs.as_dict()}, regs.read, fix_return=fix)))
        return 0

    kp = Kprobe(symbol_name="ksys_lseek", pre_handler=pre)
    target.register_kprobe(kp)
    try:
        _guest_lseek_trace_on(target)
        try:
            res = workload_result(target.run("workload lseek 3", timeout=120).check().output)
        finally:
            guest_trace = _guest_lseek_trace_off(target)
    finally:
        target.unregister_kprobe(kp)

    pid = int(res["pid"])
    assert [p for p, _ in traces] == [pid] * 3
    lines = [format_stack(addrs, target.symbols) for _, addrs in traces]
    print("\n".join(lines[0]))
    assert lines[0] == lines[1] == lines[2]
    assert [line.split("+")[0] for line in lines[0]] == [
        "[<0>] ksys_lseek", "[<0>] do_syscall_64", "[<0>] entry_SYSCALL_64_after_hwframe",
    ]  # fmt: skip
    assert lines[0][0].startswith("[<0>] ksys_lseek+0x0/")

    # The guest's own unwinder, from its kprobe event on __x64_sys_lseek (which tail-calls
    # ksys_lseek, so both have do_syscall_64 as their caller): the same return addresses.
    guest = _ftrace_stacks(guest_trace, f"workload-{pid}")
    assert len(guest) == 3, guest_trace
    for stack in guest:
        assert stack[0].startswith("__x64_sys_lseek+"), stack
        assert ["[<0>] " + s for s in stack[1:]] == lines[0][1:]

    # And every return address follows a call to the frame below it.
    addrs = traces[0][1]
    assert _call_target(target, addrs[2]) == target.symbols.address("do_syscall_64")
    callee = target.symbols.containing(_call_target(target, addrs[1]))
    assert callee is not None and callee.name in ("x64_sys_call", "__x64_sys_lseek", "ksys_lseek")


def _sleep_and_read_proc_stack(target: qprobe.Target) -> tuple[int, list[str]]:
    """Start ``sleep 2`` in the guest, and read its /proc/PID/stack once it sleeps in nanosleep."""
    out = (
        target.run(
            "sleep 2 >/dev/null 2>&1 & p=$!; echo pid=$p; for i in $(seq 50); do s=$(cat /proc/$p/stack); "
            'case "$s" in *hrtimer_nanosleep*) break;; esac; sleep 0.1; done; echo "$s"; wait',
            timeout=180,
        )
        .check()
        .output
    )
    pid = int(next(line for line in out.splitlines() if line.startswith("pid="))[4:])
    return pid, _stack_lines(out)


def test_sleeping_task_matches_proc_pid_stack_through_a_kretprobe(target: qprobe.Target,
                                                                  guard: dict[int, bytes]) -> None:  # fmt: skip
    unwinder = OrcUnwinder(target.symbols)
    kretprobes = target.kretprobes
    fix = kretprobes.fix_return
    seen: dict[int, tuple[list[int], list[int]]] = {}  # pid -> (unwound with fix_return, without)

    def pre(kp: Kprobe, regs: qprobe.PtRegs) -> int:
        task = target.current_task(regs)
        if task.comm == "sleep":
            now = {**regs.as_dict()}
            seen[task.pid] = (unwinder.unwind(now, regs.read, fix_return=fix), unwinder.unwind(now, regs.read))
        return 0

    # 1. No return probe: the guest's own view of the sleeping task is the reference.
    kp = Kprobe(symbol_name="do_nanosleep", pre_handler=pre)
    target.register_kprobe(kp)
    try:
        pid, reference = _sleep_and_read_proc_stack(target)
    finally:
        target.unregister_kprobe(kp)
    plain, _ = seen[pid]
    assert target.symbols.symbolize(plain[0]) == "do_nanosleep+0x0"
    assert _in_sched_functions(target, plain[0])  # __sched: the kernel leaves it out of /proc/PID/stack
    assert [line.split("+")[0] for line in reference] == [
        "[<0>] hrtimer_nanosleep", "[<0>] common_nsleep", "[<0>] __x64_sys_clock_nanosleep",
        "[<0>] do_syscall_64", "[<0>] entry_SYSCALL_64_after_hwframe",
    ], reference  # fmt: skip
    assert _as_proc_stack(target, plain) == reference

    # 2. hrtimer_nanosleep return-probed: its return address on the guest stack is our trampoline.
    seen.clear()
    returns: dict[int, int] = {}

    def returned(ri: qprobe.KretprobeInstance, regs: qprobe.PtRegs) -> None:
        if ri.task is not None:
            returns[ri.task.pid] = ri.ret_addr

    rp = Kretprobe(symbol_name="hrtimer_nanosleep", handler=returned)
    kp = Kprobe(symbol_name="do_nanosleep", pre_handler=pre)
    target.register_kretprobe(rp)
    try:
        target.register_kprobe(kp)
        try:
            pid, guest_view = _sleep_and_read_proc_stack(target)
        finally:
            target.unregister_kprobe(kp)
    finally:
        target.unregister_kretprobe(rp)
    fixed, raw = seen[pid]
    ours = target.kprobes.scratch.contains  # the trampolines (the host's, or the instance's own) live there
    print("\n".join(format_stack(fixed, target.symbols)))
    assert not any(ours(a) for a in fixed)
    assert _as_proc_stack(target, fixed) == reference  # frame for frame, offsets and sizes too
    assert returns.get(pid) == fixed[2]  # the instance's saved return address (into common_nsleep)
    # Without fix_return the walk meets the trampoline where hrtimer_nanosleep returns, and stops there.
    assert raw[:2] == fixed[:2] and len(raw) == 3 and ours(raw[2])
    # The guest's own unwinder stops there too: the trampoline is not kernel text to it.
    assert guest_view == reference[:1]
    assert rp.nhit >= 1 and not kretprobes.live_instances(rp)
