"""Jump-optimized probes whose hits never stop the VM (mailbox + doorbell), on ksys_lseek (called once per lseek)."""

from __future__ import annotations

import re
import time

import pytest
from drgn.helpers.linux.pid import find_task

import qprobe
from qprobe import Kprobe, Kretprobe, regs_return_value
from qprobe.arch.x86_64.decode import decode_all
from qprobe.kernel.features import thread_size
from qprobe.kernel.preempted import preempted_words

from .conftest import fake_return, workload_result

pytestmark = pytest.mark.vm


def _optimized(target: qprobe.Target, kp: Kprobe) -> bool:
    """Whether the probe is jump-optimized, from its line in the list (at the address the kernel would have)."""
    line = next(x for x in target.list_probes().splitlines() if x.split()[0] == f"{kp.at:016x}")
    return "[OPTIMIZED]" in line


def _preemption_model(target: qprobe.Target) -> str:
    """The preemption model the guest's kernel runs ("full", "voluntary", "none", "rt"), from its config and,
    where the model is chosen at boot (CONFIG_PREEMPT_DYNAMIC, Linux 5.12), from what the guest reports."""
    assert target.image is not None and target.image.config is not None, "the image has no kernel config"
    config = target.image.config_option
    if config("PREEMPT_RT") == "y":
        return "rt"
    if config("PREEMPT_DYNAMIC") == "y":
        # debugfs's sched/preempt (CONFIG_SCHED_DEBUG) lists the models with the running one in parentheses.
        listed = target.run("cat /sys/kernel/debug/sched/preempt 2>/dev/null").output
        running = re.search(r"\((\w+)\)", listed)
        if running is not None:
            return running[1]
        # Else the boot command line's preempt=, which overrides the config's default.
        given = re.search(r"(?:^|\s)preempt=(\w+)", target.run("cat /proc/cmdline").check().output)
        if given is not None:
            return given[1]
    return "full" if config("PREEMPT") == "y" else "voluntary" if config("PREEMPT_VOLUNTARY") == "y" else "none"


def test_a_sleeping_task_s_returns_are_among_the_words_the_jump_waits_for(target: qprobe.Target) -> None:
    """On a fully preemptible kernel a jump waits while a sleeping task's live stack points into its region
    (qprobe.kernel.preempted): every return address drgn unwinds from a sleeping task is among those words."""
    assert target.image is not None
    model = _preemption_model(target)
    if model not in ("full", "rt"):
        pytest.skip(f"{target.image.name}: preempt={model}, not fully preemptible (no jump waits for a sleeping task)")
    assert target.kprobes.slots.fully_preemptible, (
        f"qprobe takes a preempt={model} kernel for one that is not fully preemptible"
    )
    out = target.run("sleep 4 >/dev/null 2>&1 & echo pid=$!").check().output
    pid = int(re.search(r"pid=(\d+)", out).group(1))  # type: ignore[union-attr]

    def look() -> tuple[list[int], list[int]]:
        task = find_task(target.prog, pid)
        returns = [frame.pc for frame in target.prog.stack_trace(task)]
        return returns, preempted_words(target.kernel, thread_size(target.kernel))

    try:
        returns, words = target.machine.call(look)
        names = [target.symbols.symbolize(pc) for pc in returns]
        assert any("nanosleep" in n for n in names), names
        assert set(returns) <= set(words), [n for pc, n in zip(returns, names, strict=True) if pc not in words]
    finally:
        target.run(f"while [ -e /proc/{pid} ]; do sleep 0.2; done", timeout=30).check()


def test_optimized_probe_counts_exactly_without_stops(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    assert target.kprobes_optimization
    kp = Kprobe(symbol_name="ksys_lseek", pre_handler=lambda k, r: 0)
    target.register_kprobe(kp)
    try:
        assert _optimized(target, kp)
        served = target.kprobes.optimizer.served  # type: ignore[union-attr]
        res = workload_result(target.run("workload lseek 20000", timeout=600).check().output)
        assert target.kprobes.optimizer.served - served == 20000  # type: ignore[union-attr]
    finally:
        target.unregister_kprobe(kp)
    assert res["n"] == "20000" and kp.nhit == 20000 and kp.nmissed == 0


def test_handlerless_probe_counts_in_the_guest(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    """No handler to run: the detour only increments a counter in guest RAM and wakes nobody."""
    kp = Kprobe(symbol_name="ksys_lseek")
    target.register_kprobe(kp)
    try:
        assert _optimized(target, kp)
        point = target.kprobes.points[kp.resolved]
        assert point.opt is not None and point.opt.kind == "count"
        served = target.kprobes.optimizer.served  # type: ignore[union-attr]
        res = workload_result(target.run("workload lseek 20000", timeout=600).check().output)
        assert target.kprobes.optimizer.served == served  # type: ignore[union-attr]
        deadline = time.monotonic() + 5
        while kp.nhit < 20000 and time.monotonic() < deadline:  # the collector folds every 50 ms
            time.sleep(0.05)
        assert kp.nhit == 20000
        # A probe with a handler joins the point: the detour becomes the mailbox one, counts carry on.
        seen: list[int] = []
        other = Kprobe(symbol_name="ksys_lseek", pre_handler=lambda k, r: seen.append(r.vcpu))
        target.register_kprobe(other)
        try:
            assert _optimized(target, other) and target.kprobes.points[kp.resolved].opt.kind == "mailbox"  # type: ignore[union-attr]
            target.run("workload lseek 100").check()
        finally:
            target.unregister_kprobe(other)
        assert len(seen) == 100 and other.nhit == 100
    finally:
        target.unregister_kprobe(kp)
    assert res["n"] == "20000" and kp.nhit == 20100 and kp.nmissed == 0


def test_optimized_handler_sees_arguments_and_task(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    seen: list[tuple[int, int, str]] = []
    kp = Kprobe(symbol_name="ksys_lseek",
                pre_handler=lambda k, r: seen.append((r.si, r.dx, target.current_task(r).comm)))  # fmt: skip
    target.register_kprobe(kp)
    try:
        assert _optimized(target, kp)
        target.run("workload lseek 30").check()
    finally:
        target.unregister_kprobe(kp)
    assert seen == [(i, 0, "workload") for i in range(1, 31)]


def test_optimized_pre_handler_can_skip_the_function(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    kp = Kprobe(symbol_name="ksys_lseek", pre_handler=fake_return(4242))
    target.register_kprobe(kp)
    try:
        assert _optimized(target, kp)
        res = workload_result(target.run("workload lseek 50").check().output)
    finally:
        target.unregister_kprobe(kp)
    assert res["ret"] == "4242" and res["errors"] == "0" and kp.nhit == 50


def test_both_vcpus_through_their_own_mailboxes(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    cpus: list[int] = []
    kp = Kprobe(symbol_name="ksys_lseek", pre_handler=lambda k, r: cpus.append(r.vcpu))
    target.register_kprobe(kp)
    try:
        assert _optimized(target, kp)
        target.run("taskset -c 0 workload lseek 3000 & taskset -c 1 workload lseek 3000; wait",
                   timeout=600).check()  # fmt: skip
    finally:
        target.unregister_kprobe(kp)
    assert kp.nhit == 6000 and cpus.count(0) == 3000 and cpus.count(1) == 3000


def test_post_handler_and_knob_unoptimize_and_counts_stay_exact(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    a = Kprobe(symbol_name="ksys_lseek")
    target.register_kprobe(a)
    try:
        assert _optimized(target, a)
        b = Kprobe(symbol_name="ksys_lseek", post_handler=lambda k, r: None)
        target.register_kprobe(b)
        assert not _optimized(target, a)  # a post_handler needs the single-step
        target.run("workload lseek 10").check()
        target.unregister_kprobe(b)
        assert _optimized(target, a)
        target.set_kprobes_optimization(False)
        assert not _optimized(target, a)
        target.run("workload lseek 10").check()
        target.set_kprobes_optimization(True)
        assert _optimized(target, a)
        # Disabled, then enabled again (one probe, then every probe): optimized again, as the kernel re-arms.
        target.disable_kprobe(a)
        assert not _optimized(target, a)
        target.enable_kprobe(a)
        assert _optimized(target, a)
        target.set_kprobes_enabled(False)
        target.set_kprobes_enabled(True)
        assert _optimized(target, a)
        target.run("workload lseek 10").check()
    finally:
        target.set_kprobes_optimization(True)
        if a.registered:
            target.unregister_kprobe(a)
    assert (a.nhit, b.nhit) == (30, 10)


def test_a_probe_inside_an_optimized_region_unoptimizes_it(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    sym = target.symbols.lookup("ksys_lseek")
    insns = decode_all(target.read(sym.addr, sym.size), sym.addr)
    # A short instruction after the entry: its jump displaces the next one(s) too.
    first_insn = next(i for i in insns[1:] if i.length < 5)
    first = Kprobe(addr=first_insn.addr)
    target.register_kprobe(first)
    try:
        assert _optimized(target, first)
        opt = target.kprobes.points[first_insn.addr].opt
        assert opt is not None and opt.size > first_insn.length
        second = Kprobe(addr=first_insn.addr + first_insn.length)
        target.register_kprobe(second)
        assert not _optimized(target, first)
        target.run("workload lseek 5").check()
        target.unregister_kprobe(second)
    finally:
        target.unregister_kprobe(first)
    assert second.nhit == 5 and first.nhit >= 5


def test_handler_exception_on_the_optimized_path(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    def boom(kp: Kprobe, regs: qprobe.PtRegs) -> None:
        raise ValueError("bad handler")

    kp = Kprobe(symbol_name="ksys_lseek", pre_handler=boom)
    target.register_kprobe(kp)
    try:
        assert _optimized(target, kp)
        res = workload_result(target.run("workload lseek 25").check().output)
    finally:
        target.unregister_kprobe(kp)
    assert res["errors"] == "0" and kp.nhit == 25 and kp.nfaults == 25


# -- return probes whose instances live in guest RAM ---------------------------------------------
def test_handlerless_kretprobe_counts_entries_and_returns_in_the_guest(target: qprobe.Target,
                                                                       guard: dict[int, bytes]) -> None:  # fmt: skip
    """rf: the entry detour takes an instance, the instance's trampoline counts the return; nobody is woken."""
    rp = Kretprobe(symbol_name="ksys_lseek")
    target.register_kretprobe(rp)
    try:
        assert _optimized(target, rp.kp)
        assert target.kprobes.points[rp.kp.resolved].opt.kind == "retentry"  # type: ignore[union-attr]
        served, stops = target.kprobes.optimizer.served, target.kprobes.dispatcher.ntraps  # type: ignore[union-attr]
        res = workload_result(target.run("workload lseek 20000", timeout=600).check().output)
        assert target.kprobes.optimizer.served == served  # type: ignore[union-attr]
        assert target.kprobes.dispatcher.ntraps == stops
        assert not target.kretprobes.live_instances(rp)
    finally:
        target.unregister_kretprobe(rp)
    assert res["n"] == "20000" and res["errors"] == "0"
    assert (rp.nhit, rp.nreturns, rp.nmissed) == (20000, 20000, 0)


def test_optimized_kretprobe_handler_wakes_the_host_only_at_the_return(target: qprobe.Target,
                                                                      guard: dict[int, bytes]) -> None:  # fmt: skip
    """ro: the entry is taken in the guest; each return hands its registers to the handler through the mailbox."""
    seen: list[tuple[int, str, str]] = []

    def ret(ri: qprobe.KretprobeInstance, regs: qprobe.PtRegs) -> None:
        assert ri.task is not None
        seen.append((regs_return_value(regs), ri.task.comm, target.symbols.symbolize(ri.ret_addr).split("+")[0]))

    rp = Kretprobe(symbol_name="ksys_lseek", handler=ret)
    target.register_kretprobe(rp)
    try:
        assert _optimized(target, rp.kp)
        served = target.kprobes.optimizer.served  # type: ignore[union-attr]
        target.run("workload lseek 300", timeout=300).check()
        assert target.kprobes.optimizer.served - served == 300  # type: ignore[union-attr]
    finally:
        target.unregister_kretprobe(rp)
    callers = {name for _, _, name in seen}
    assert [v for v, _, _ in seen] == list(range(1, 301)) and {c for _, c, _ in seen} == {"workload"}
    assert len(callers) == 1 and callers <= {"__x64_sys_lseek", "do_syscall_64", "x64_sys_call"}
    assert (rp.nhit, rp.nreturns, rp.nmissed) == (300, 300, 0)


def test_guest_instances_run_out_like_the_kernel_s(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    """maxactive=1 and two overlapping sleeps on the optimized path: one return, one nmissed."""
    rp = Kretprobe(symbol_name="hrtimer_nanosleep", maxactive=1)
    target.register_kretprobe(rp)
    try:
        assert _optimized(target, rp.kp)
        target.run("sleep 1 & sleep 1 & wait", timeout=120).check()
    finally:
        target.unregister_kretprobe(rp)
    assert (rp.nhit, rp.nreturns, rp.nmissed) == (2, 1, 1)
