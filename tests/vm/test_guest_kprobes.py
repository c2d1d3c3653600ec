"""The guest kernel's own kprobes on the instruction qprobe probes, in either order.

qprobe arms a function's entry probe on the instruction after its ``__fentry__``
site; the guest's ``p:x FUNC`` is armed through ftrace on the site itself, and
``p:x FUNC+OFF`` on qprobe's very instruction.  Whichever comes second is
refused cleanly or works: the guest's kprobe on qprobe's int3 by its own
``__copy_instruction`` check, on qprobe's jump by the guest's ``kprobe_blacklist``
entry qprobe adds; qprobe's on the guest's int3 or jump by the guest's
``kprobe_table``.  The guest's ftrace-based probe on the same function works
beside qprobe's.  Counts are the workload's own, the console has no oops, and
the text is byte-identical once both are gone (the plugin's watch).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

import qprobe
from qprobe import Kprobe
from qprobe.errors import ProbeBusy
from qprobe.pytest_plugin import QprobeReset, qprobe_scope

from .conftest import wait_for_optimizer, workload_result
from .guest_oracle import TRACING

pytestmark = [pytest.mark.vm, pytest.mark.qprobe_needs_config("KPROBE_EVENTS")]

FUNCTION = "ksys_lseek"  # `workload lseek N` calls it exactly N times
CALLS = 5
DEBUG_KPROBES = "/sys/kernel/debug/kprobes"
OPTIMIZATION = "/proc/sys/debug/kprobes-optimization"


@pytest.fixture(scope=qprobe_scope)
def qprobe_boot_kwargs() -> dict[str, Any]:
    """One TCG thread: the guest enables its ftrace-based event with text_poke_bp (see test_oracle)."""
    return {"tcg_thread": "single"}


def _add_guest_event(target: qprobe.Target, name: str, where: str) -> bool:
    """Define and enable the guest's own kprobe event; whether the guest kernel accepted it."""
    res = target.run(f"echo 'p:{name} {where}' >> {TRACING}/kprobe_events && "
                     f"echo 1 > {TRACING}/events/kprobes/{name}/enable")  # fmt: skip
    return res.status == 0


def _remove_guest_events(target: qprobe.Target, names: list[str]) -> None:
    for name in names:
        target.run(f"echo 0 > {TRACING}/events/kprobes/{name}/enable; echo '-:{name}' >> {TRACING}/kprobe_events")


def _guest_hits(profile: str, name: str) -> int:
    return next(int(line.split()[1]) for line in profile.splitlines() if line.split()[:1] == [name])


@pytest.mark.parametrize("jump", [False, True], ids=["int3", "jump"])
@pytest.mark.parametrize("qprobe_first", [True, False], ids=["qprobe-first", "guest-first"])
def test_guest_kprobe_on_qprobes_instruction(
    target: qprobe.Target, qprobe_reset: QprobeReset, jump: bool, qprobe_first: bool
) -> None:
    qprobe_reset.watch(FUNCTION)
    before = len(target.oopses())
    start = target.symbols.address(FUNCTION)
    probe = Kprobe(symbol_name=FUNCTION)
    target.register_kprobe(probe)  # where qprobe arms FUNCTION's entry probe on this kernel
    at = probe.resolved
    target.unregister_kprobe(probe)
    same = f"{FUNCTION}+{at - start}"
    kp = Kprobe(symbol_name=FUNCTION)
    guest_knob = target.run(f"cat {OPTIMIZATION}").check().output.strip()
    target.run(f"echo {int(jump)} > {OPTIMIZATION}").check()  # the guest's probes: int3s or jumps
    target.set_kprobes_optimization(jump)
    added = []
    try:
        if qprobe_first:
            target.register_kprobe(kp)
            if jump:
                wait_for_optimizer(target)
                assert "[OPTIMIZED]" in target.list_probes()
            # The guest kernel refuses its kprobe on qprobe's instruction, whichever form it has.
            assert not _add_guest_event(target, "gsame", same)
        else:
            assert _add_guest_event(target, "gsame", same)
            added.append("gsame")
            if jump:  # the guest's optimizer places its jump a few jiffies later
                deadline = time.monotonic() + 30
                while "[OPTIMIZED]" not in target.run(f"cat {DEBUG_KPROBES}/list").output:
                    assert time.monotonic() < deadline, "the guest never optimized its kprobe"
                    time.sleep(0.5)
            with pytest.raises(ProbeBusy):
                target.register_kprobe(kp)
        # The guest's probe on the same function, through its ftrace site, works beside qprobe's.
        assert _add_guest_event(target, "gfunc", FUNCTION)
        added.append("gfunc")
        res = workload_result(target.run(f"workload lseek {CALLS}").check().output)
        profile = target.run(f"cat {TRACING}/kprobe_profile").check().output
    finally:
        if kp.registered:
            target.unregister_kprobe(kp)
        _remove_guest_events(target, added)
        target.run(f"echo {guest_knob} > {OPTIMIZATION}")
        target.set_kprobes_optimization(True)
    assert res["errors"] == "0"
    assert _guest_hits(profile, "gfunc") == CALLS
    if qprobe_first:
        assert kp.nhit == CALLS
    else:
        assert _guest_hits(profile, "gsame") == CALLS and kp.nhit == 0
    assert target.oopses()[before:] == []
    # Both gone: the guest's kprobes work there again (nothing of qprobe's is left in its blacklist).
    assert _add_guest_event(target, "gagain", same)
    _remove_guest_events(target, ["gagain"])
