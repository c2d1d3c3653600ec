"""Stack traces in handlers (drgn's, from the hit's registers) on the real default image.

Two references that owe nothing to qprobe or drgn: the guest kernel's own
unwinder (its ftrace kprobe events print the stack from a probe's
registers with ``options/stacktrace``, and ``/proc/PID/stack`` prints a
sleeping task's), for the return addresses; and binutils' addr2line on the
same vmlinux, for the functions, inlined calls and file:line of each frame.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import drgn
import pytest

import qprobe
from qprobe import Kprobe, Kretprobe
from qprobe.events import EventHit

from .conftest import workload_result

pytestmark = pytest.mark.vm

TRACING = "/sys/kernel/tracing"
EVENT = "qprobe_stack/lseek"


def _proc_stack_lines(output: str) -> list[str]:
    return [line.strip().removeprefix("[<0>] ") for line in output.splitlines() if line.startswith("[<0>] ")]


def _address(target: qprobe.Target, kallsyms_line: str) -> int:
    """``sym+0xoff/0xsize`` (as the kernel prints a return address) -> the address."""
    name, _, rest = kallsyms_line.partition("+")
    return target.symbols.address(name) + int(rest.split("/")[0], 16)


def _returns(trace: qprobe.Stack) -> list[int]:
    """The pcs of the real frames (an inlined call shares its caller's pc)."""
    return [frame.pc for frame in trace if not frame.is_inline]


def _in_sched_functions(target: qprobe.Target, addr: int) -> bool:
    """The kernel's in_sched_functions(): /proc/PID/stack leaves these frames out (the sleep itself)."""
    ranges = [("__sched_text_start", "__sched_text_end"), ("__lock_text_start", "__lock_text_end")]
    return any(target.symbols.address(lo) <= addr < target.symbols.address(hi) for lo, hi in ranges
               if lo in target.symbols and hi in target.symbols)  # fmt: skip


def _addr2line(target: qprobe.Target, trace: qprobe.Stack) -> list[tuple[str | None, str, int]]:
    """(function, file, line) of every frame, inlined calls first, as binutils reads vmlinux's DWARF.

    A return address is looked up at the byte before it (the call), the hit itself where it is.
    The function is None where DWARF has none (assembly): addr2line then names the nearest
    symbol and drgn the containing one.
    """
    pcs = _returns(trace)
    looks = [pc - target.slide - (0 if i == 0 else 1) for i, pc in enumerate(pcs)]
    out = subprocess.run(["addr2line", "-a", "-i", "-f", "-e", str(target.symbols.path), *map(hex, looks)],
                         capture_output=True, text=True, check=True).stdout.splitlines()  # fmt: skip
    frames: list[tuple[str | None, str, int]] = []
    i = 0
    while i < len(out):
        assert out[i].startswith("0x"), out  # -a: each address, then its inlined chain, innermost first
        i += 1
        while i < len(out) and not out[i].startswith("0x"):
            function, where = out[i], out[i + 1]
            file, _, line = where.rpartition(":")
            frames.append((None if where.endswith(".S:" + line) else function, file, int(line.split()[0])))
            i += 2
    return frames


def _drgn_view(trace: qprobe.Stack) -> list[tuple[str | None, str, int]]:
    out = []
    for frame in trace:
        try:
            file, line, _column = frame.source()
        except LookupError:
            file, line = "??", 0
        out.append((frame.function_name, file, line))
    return out


def _same_frames(ours: list[tuple[str | None, str, int]], reference: list[tuple[str | None, str, int]]) -> None:
    """Frame for frame; addr2line prints the build directory's path, drgn the source tree's."""
    assert len(ours) == len(reference), (ours, reference)
    for (name, file, line), (ref_name, ref_file, ref_line) in zip(ours, reference, strict=True):
        assert (name, Path(file).parts[-2:], line) == (ref_name, Path(ref_file).parts[-2:], ref_line), (
            ours, reference)  # fmt: skip


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
    """The ``<stack trace>`` blocks of one task in an ftrace text trace: ['sym+0x../0x..', ...] each."""
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


@pytest.mark.qprobe_needs_config("KPROBE_EVENTS")  # the guest's own stack trace is its kprobe event's
def test_lseek_stack_matches_the_guest_s_own(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    traces: list[tuple[int, qprobe.Stack]] = []
    ips: list[int] = []

    def pre(kp: Kprobe, regs: qprobe.PtRegs) -> int:
        task = target.current_task(regs)
        if task.comm == "workload":
            traces.append((task.pid, regs.stack_trace()))
            ips.append(regs.ip)
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
    print(traces[0][1])
    ours = [_returns(trace) for _, trace in traces]
    assert ours[0] == ours[1] == ours[2]
    fn = target.symbols.containing(ips[0])
    assert ours[0][0] == ips[0] and fn is not None and fn.name == "ksys_lseek"  # the hit, where it is
    # The guest's own unwinder, from its kprobe event on __x64_sys_lseek (which tail-calls
    # ksys_lseek, so both have do_syscall_64 as their caller): the same return addresses,
    # down to where the task entered the kernel.
    guest = _ftrace_stacks(guest_trace, f"workload-{pid}")
    assert len(guest) == 3, guest_trace
    for stack in guest:
        assert stack[0].startswith("__x64_sys_lseek+"), stack
        assert [_address(target, line) for line in stack[1:]] == ours[0][1:]
    # Every frame, inlined calls included, with its function and file:line as addr2line reads them.
    _same_frames(_drgn_view(traces[0][1]), _addr2line(target, traces[0][1]))


def test_three_calls_deep_lists_the_callers_in_order(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    """ksys_lseek -> vfs_llseek -> generic_file_llseek_size (through the file's llseek), each with file:line."""
    traces: list[qprobe.Stack] = []

    def pre(kp: Kprobe, regs: qprobe.PtRegs) -> None:
        if target.current_task(regs).comm == "workload":
            traces.append(regs.stack_trace())

    kp = Kprobe(symbol_name="generic_file_llseek_size", pre_handler=pre)
    target.register_kprobe(kp)
    try:
        target.run("workload lseek 2").check()
    finally:
        target.unregister_kprobe(kp)
    assert len(traces) == 2
    print(traces[0])
    view = _drgn_view(traces[0])
    _same_frames(view, _addr2line(target, traces[0]))
    names = [frame.name for frame in traces[0]]
    callers = [names.index(n) for n in ("generic_file_llseek_size", "vfs_llseek", "ksys_lseek", "do_syscall_64")]
    assert callers == sorted(callers) and callers[0] == 0, names
    # A source file each (x64_sys_call's switch is inlined from the generated syscalls_64.h).
    assert all(line > 0 and file.endswith((".c", ".h")) for name, file, line in view if name is not None)


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
    return pid, _proc_stack_lines(out)


@pytest.mark.qprobe_needs_config("STACKTRACE")  # /proc/PID/stack
def test_sleeping_task_matches_proc_pid_stack_through_a_kretprobe(target: qprobe.Target,
                                                                  guard: dict[int, bytes]) -> None:  # fmt: skip
    seen: dict[int, qprobe.Stack] = {}

    def pre(kp: Kprobe, regs: qprobe.PtRegs) -> int:
        task = target.current_task(regs)
        if task.comm == "sleep":
            seen[task.pid] = regs.stack_trace()
        return 0

    # 1. No return probe: the guest's own view of the sleeping task is the reference.
    kp = Kprobe(symbol_name="do_nanosleep", pre_handler=pre)
    target.register_kprobe(kp)
    try:
        pid, reference = _sleep_and_read_proc_stack(target)
    finally:
        target.unregister_kprobe(kp)
    plain = _returns(seen[pid])
    fn = target.symbols.containing(plain[0])
    assert fn is not None and fn.name == "do_nanosleep"
    assert _in_sched_functions(target, plain[0])  # __sched: the kernel leaves it out of /proc/PID/stack
    assert [line.split("+")[0] for line in reference] == [
        "hrtimer_nanosleep", "common_nsleep", "__x64_sys_clock_nanosleep", "do_syscall_64",
        "entry_SYSCALL_64_after_hwframe",
    ], reference  # fmt: skip
    expected = [_address(target, line) for line in reference]
    assert [a for a in plain if not _in_sched_functions(target, a)] == expected

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
    fixed = _returns(seen[pid])
    print(seen[pid])
    ours = target.kprobes.scratch.contains  # the trampolines (the host's, or the instance's own) live there
    assert not any(ours(a) for a in fixed)
    assert [a for a in fixed if not _in_sched_functions(target, a)] == expected  # frame for frame
    assert returns.get(pid) == fixed[2]  # the instance's saved return address (into common_nsleep)
    # The guest's own unwinder stops at the trampoline: it is not kernel text to it.
    assert guest_view == reference[:1]
    assert rp.nhit >= 1 and not target.kretprobes.live_instances(rp)
    # The frames are drgn's own: file:line for the C ones. The file is named as the build named it:
    # Debian builds its rt flavour in debian/build/source_rt/, its cloud one in the tree's top.
    assert isinstance(seen[pid][0], drgn.StackFrame)
    source = seen[pid][0].source()[0]
    assert source == "kernel/time/hrtimer.c" or source.endswith("/kernel/time/hrtimer.c"), source


def test_symbol_sizes_are_kallsyms_own(target: qprobe.Target) -> None:
    """``sym+off/SIZE`` (``:symbol``, ``%pS``): SIZE is the distance to the next address /proc/kallsyms lists,
    for data as for functions (the ELF has symbols kallsyms leaves out: linux_banner's ELF neighbour is not
    kallsyms' on Debian's 6.1)."""
    names = ("linux_banner", "jiffies", "init_task", "_sdata", "vfs_read", "ksys_lseek", "schedule")
    target.run("awk '{print $1}' /proc/kallsyms | sort -u > /tmp/kaddrs").check()
    sizes = []
    for name in names:
        sym = target.symbols.lookup(name)
        script = f"awk -v a={sym.addr:016x} '$1 > a {{print; exit}}' /tmp/kaddrs"
        sizes.append(int(target.run(script).check().output, 16) - sym.addr)
        assert target.symbols.kallsyms_size(sym) == sizes[-1], name
    # As a :symbol argument prints them (a name with an alias at its address may print as the alias).
    args = " ".join(f"a{i}=\\{target.symbols.address(n):#x}:symbol" for i, n in enumerate(names))
    hits: list[EventHit] = []
    te = target.add_event(f"p:qpsym ksys_lseek {args}", hits.append)
    try:
        target.run("workload lseek 1").check()
    finally:
        target.remove_event(te)
    assert hits
    for i, (name, size) in enumerate(zip(names, sizes, strict=True)):
        assert hits[-1].args[f"a{i}"].endswith(f"+0x0/{size:#x}"), (name, hits[-1].args)
