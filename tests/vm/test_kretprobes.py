"""Issue 4: return probes from the host on the real default image."""

from __future__ import annotations

import re
import time

import pytest

import qprobe
from qprobe import Kretprobe, regs_return_value
from qprobe.errors import InvalidProbe, ProbeError

from .conftest import frames_above, workload_result

pytestmark = pytest.mark.vm
ENOMEM = 12
# lseek(2) as the source calls it. x64_sys_call's switch replaced the call through sys_call_table
# in Linux 6.9 ("x86/syscall: Don't force use of indirect calls for system calls", in 6.1.y too).
# Which of these calls are tail calls, and so where ksys_lseek returns to, is the compiler's
# choice: frames_above reads it from the image's vmlinux.
LSEEK_PATH = ("entry_SYSCALL_64", "do_syscall_64", "x64_sys_call", "__x64_sys_lseek", "ksys_lseek")


def test_return_values_task_and_private_data(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    seen: list[tuple[int, str, int, bytes, str]] = []

    def entry(ri: qprobe.KretprobeInstance, regs: qprobe.PtRegs) -> int:
        ri.data[:8] = regs.si.to_bytes(8, "little")  # the offset argument
        return 0

    def ret(ri: qprobe.KretprobeInstance, regs: qprobe.PtRegs) -> None:
        assert ri.task is not None
        seen.append((regs_return_value(regs), ri.task.comm, ri.task.pid, bytes(ri.data[:8]),
                     target.symbols.symbolize(ri.ret_addr)))  # fmt: skip

    rp = Kretprobe(symbol_name="ksys_lseek", handler=ret, entry_handler=entry, data_size=8)
    target.register_kretprobe(rp)
    assert "  r  ksys_lseek+0x0" in target.list_probes()
    try:
        res = workload_result(target.run("workload lseek 20").check().output)
    finally:
        target.unregister_kretprobe(rp)
    pid = int(res["pid"])
    # lseek(fd, i, SEEK_SET) returns i; the entry handler saw the same i.
    assert [s[:4] for s in seen] == [(i, "workload", pid, i.to_bytes(8, "little")) for i in range(1, 21)]
    # Each call returned after the call instruction in the innermost caller that did not tail-call.
    assert target.image is not None
    _, sites = frames_above(target.image, LSEEK_PATH)[0]
    assert {s[4] for s in seen} <= sites, (seen, sites)
    assert rp.nhit == 20 and rp.nmissed == 0 and not rp.live


def test_an_anywhere_return_probe_writes_nothing_and_sees_every_return(
        target: qprobe.Target, guard: dict[int, bytes], monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Kretprobe(anywhere=True): the return caught on a stub breakpoint at the return address, the stack
    left as the call made it (no trampoline address written), matched to its call by task and stack pointer."""
    seen: list[tuple[int, str, int, bytes, str]] = []
    patched: list[int] = []

    def entry(ri: qprobe.KretprobeInstance, regs: qprobe.PtRegs) -> int:
        ri.data[:8] = regs.si.to_bytes(8, "little")
        return 0

    def ret(ri: qprobe.KretprobeInstance, regs: qprobe.PtRegs) -> None:
        assert ri.task is not None
        seen.append((regs_return_value(regs), ri.task.comm, ri.task.pid, bytes(ri.data[:8]),
                     target.symbols.symbolize(regs.ip)))  # fmt: skip

    machine = target.machine
    for name in ("patch", "patch_data"):  # every write qprobe makes into the guest, code or data
        write = getattr(machine, name)
        monkeypatch.setattr(
            machine, name, lambda virt, *a, write=write, **k: patched.append(virt) or write(virt, *a, **k)
        )
    rp = Kretprobe(symbol_name="ksys_lseek", handler=ret, entry_handler=entry, data_size=8, anywhere=True)
    target.register_kretprobe(rp)
    assert "  r  ksys_lseek+0x0    [ANYWHERE]" in target.list_probes()
    try:
        res = workload_result(target.run("workload lseek 20").check().output)
    finally:
        target.unregister_kretprobe(rp)
    assert patched == []  # not a byte written into the guest: no int3, no return address
    pid = int(res["pid"])
    assert [s[:4] for s in seen] == [(i, "workload", pid, i.to_bytes(8, "little")) for i in range(1, 21)]
    assert target.image is not None
    _, sites = frames_above(target.image, LSEEK_PATH)[0]
    assert {s[4] for s in seen} <= sites, (seen, sites)
    assert rp.nhit == 20 and rp.nreturns == 20 and rp.nmissed == 0
    assert target.kretprobes.stub_returns.sites == {}  # every return site's breakpoint gone with its call


def test_fault_injection_through_the_return_value(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    calls = []

    def fail_once(ri: qprobe.KretprobeInstance, regs: qprobe.PtRegs) -> None:
        calls.append(1)
        if len(calls) == 2:
            regs.ax = -ENOMEM & (2**64 - 1)

    rp = Kretprobe(symbol_name="__x64_sys_getppid", handler=fail_once)
    target.register_kretprobe(rp)
    try:
        res = workload_result(target.run("workload getppid 5").check().output)
    finally:
        target.unregister_kretprobe(rp)
    assert res["errors"] == "1" and res["errnos"] == "ENOMEM:1"


def test_entry_handler_nonzero_leaves_the_call_alone(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    returns = []
    rp = Kretprobe(symbol_name="ksys_lseek", handler=lambda ri, regs: returns.append(regs.ax),
                   entry_handler=lambda ri, regs: 1 if regs.si % 2 else 0)  # fmt: skip
    target.register_kretprobe(rp)
    try:
        target.run("workload lseek 10").check()
    finally:
        target.unregister_kretprobe(rp)
    assert returns == [2, 4, 6, 8, 10] and rp.nhit == 10


def test_maxactive_bounds_live_calls_and_counts_nmissed(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    returned = []
    rp = Kretprobe(symbol_name="hrtimer_nanosleep", handler=lambda ri, regs: returned.append(ri.task.pid),
                   maxactive=1)  # fmt: skip
    target.register_kretprobe(rp)
    try:
        target.run("sleep 1 & sleep 1 & wait", timeout=120).check()
    finally:
        target.unregister_kretprobe(rp)
    # Both sleeps overlapped; the second found no free instance.
    assert rp.nhit == 2 and rp.nmissed == 1 and len(returned) == 1


@pytest.mark.qprobe_needs_config("KPROBE_EVENTS")
def test_default_maxactive_follows_the_kernel(target: qprobe.Target) -> None:
    """The guest's own return event with no maxactive lists the default its kernel chose."""
    tracing = "/sys/kernel/tracing"
    listing = target.run(f"echo 'r:gmax ksys_read' >> {tracing}/kprobe_events && cat {tracing}/kprobe_events; "
                         f"echo '-:gmax' >> {tracing}/kprobe_events").check().output  # fmt: skip
    m = re.search(r"^r(\d+):kprobes/gmax ", listing, re.M)
    assert m is not None, listing
    assert target.kretprobes.default_maxactive() == int(m[1])


def test_unregister_with_a_call_in_flight_restores_its_return(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    rp = Kretprobe(symbol_name="hrtimer_nanosleep", handler=lambda ri, regs: None)
    target.register_kretprobe(rp)
    try:
        target.run("(sleep 3; echo slept > /tmp/slept) >/dev/null 2>&1 &").check()
        deadline = time.monotonic() + 60
        while not target.kretprobes.live_instances(rp) and time.monotonic() < deadline:
            time.sleep(0.05)
        (ri,) = target.kretprobes.live_instances(rp)
        assert ri.task is not None and ri.task.comm == "sleep"
        # The sleeper's return address on its stack is a trampoline's; the instance knows the real one.
        assert target.symbols.function(ri.ret_addr) is not None
        assert target.mem.read_u64(ri.stack_slot) != ri.ret_addr
    finally:
        target.unregister_kretprobe(rp)
    assert target.mem.read_u64(ri.stack_slot) == ri.ret_addr
    # The sleeper returns through its real return address: the guest carries on.
    target.run("while [ ! -e /tmp/slept ]; do sleep 0.2; done; rm /tmp/slept", timeout=120).check()
    assert rp.nhit == 1 and not target.kretprobes.live_instances(rp) and rp.nreturns == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"symbol_name": "ksys_lseek", "offset": 4}, InvalidProbe, "function entry"),
        ({"symbol_name": "__switch_to"}, ProbeError, "does not return"),
        ({"symbol_name": "do_exit"}, ProbeError, "does not return"),
    ],
)
def test_bad_kretprobes_are_refused(target: qprobe.Target, guard: dict[int, bytes], kwargs: dict, error: type,
                                    match: str) -> None:  # fmt: skip
    with pytest.raises(error, match=match):
        target.register_kretprobe(Kretprobe(**kwargs))
    assert not target.kprobes.points


def test_stack_trace_in_a_handler_shows_the_real_return_address(target: qprobe.Target,
                                                                guard: dict[int, bytes]) -> None:  # fmt: skip
    traces: list[qprobe.Stack] = []
    rp = Kretprobe(symbol_name="ksys_lseek", handler=lambda ri, regs: traces.append(regs.stack_trace()))
    kp = qprobe.Kprobe(symbol_name="ksys_lseek", pre_handler=lambda k, regs: traces.append(regs.stack_trace()))
    target.register_kretprobe(rp)
    target.register_kprobe(kp)
    try:
        target.run("workload lseek 1").check()
    finally:
        target.unregister_kprobe(kp)
        target.unregister_kretprobe(rp)
    entry, ret = traces
    names = [[frame.name for frame in t if not frame.is_inline] for t in traces]
    assert target.image is not None
    frames = frames_above(target.image, LSEEK_PATH)
    assert names[0] == ["ksys_lseek", *(name for name, _ in frames)], str(entry)
    assert target.symbols.symbolize(entry[1].pc) in frames[0][1], str(entry)
    # At the return the trampoline is never shown: the unwinder sees the real return address,
    # in the caller, and goes on from there.
    assert names[1] == names[0][1:], str(ret)
    assert ret[0].pc == entry[1].pc and not any(target.kprobes.scratch.contains(f.pc) for f in ret)


def test_a_thousand_entry_and_return_pairs_match(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    pairs: list[tuple[int, int]] = []

    def entry(ri: qprobe.KretprobeInstance, regs: qprobe.PtRegs) -> int:
        ri.data[:8] = regs.arg("offset").to_bytes(8, "little")
        return 0

    rp = Kretprobe(symbol_name="ksys_lseek", entry_handler=entry, data_size=8,
                   handler=lambda ri, regs: pairs.append((int.from_bytes(ri.data[:8], "little"),
                                                          regs_return_value(regs))))  # fmt: skip
    target.register_kretprobe(rp)
    try:
        target.run("workload lseek 1000", timeout=600).check()
    finally:
        target.unregister_kretprobe(rp)
    assert pairs == [(i, i) for i in range(1, 1001)]
    assert rp.nmissed == 0 and rp.maxactive == 0  # the default pool sufficed


def test_stack_trace_in_a_nested_kretprobed_call(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    """Linux's test_stacktrace_on_nested_kretprobe: both real return addresses, in order."""
    inner_traces: list[qprobe.Stack] = []
    outer = Kretprobe(symbol_name="ksys_lseek", handler=lambda ri, regs: None)
    inner = Kretprobe(symbol_name="generic_file_llseek_size",
                      handler=lambda ri, regs: inner_traces.append(regs.stack_trace()))  # fmt: skip
    target.register_kretprobes([outer, inner])
    try:
        target.run("workload lseek 2").check()
    finally:
        target.unregister_kretprobes([inner, outer])
    assert len(inner_traces) == 2
    for trace in inner_traces:
        names = [frame.name for frame in trace]
        # The inner function returns into its caller; ksys_lseek (probed too) into do_syscall_64.
        assert "ksys_lseek" in names and "do_syscall_64" in names, str(trace)
        assert names.index("ksys_lseek") < names.index("do_syscall_64")
        assert not any(target.kprobes.scratch.contains(frame.pc) for frame in trace), str(trace)
