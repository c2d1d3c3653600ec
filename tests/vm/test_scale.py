"""A thousand probes at once: one batch in, counts exact, one batch out, kernel text as it was."""

from __future__ import annotations

from typing import Any

import pytest

import qprobe
from qprobe import Kprobe
from qprobe.bench import probeable_entries, reached_functions
from qprobe.pytest_plugin import qprobe_scope

from .conftest import wait_for_optimizer, workload_result

pytestmark = pytest.mark.vm

N = 1000


@pytest.fixture(scope=qprobe_scope)
def qprobe_boot_kwargs() -> dict[str, Any]:
    """This module's VM runs both vCPUs on one TCG thread: the guest's function tracer patches tens of
    thousands of sites through text_poke_bp, and under QEMU 7.2's multi-threaded TCG a vCPU can keep running
    a stale translation of one of its int3s with interrupts off while the other waits in the IPI (a soft
    lockup in smp_call_function_many_cond, seen in a make test run; docs/reliability.md)."""
    return {"tcg_thread": "single"}


@pytest.mark.qprobe_needs_config("FUNCTION_TRACER")  # the functions the guest reaches, from its function tracer
def test_a_thousand_probes_count_exactly_and_leave_the_text_as_it_was(target: qprobe.Target) -> None:
    # Functions the guest reaches (its function tracer, over its own traceable functions), so that the
    # probes are hit; ksys_lseek among them, whose calls the workload counts.
    names = reached_functions(
        target,
        "workload lseek 10 >/dev/null; cat /proc/version >/dev/null; ls -l /proc/self/ "
        ">/dev/null; cat /proc/self/maps /proc/meminfo >/dev/null; sh -c 'sleep 0'",
    )
    names = [n for n in probeable_entries(target, names) if n != "ksys_lseek"]
    assert len(names) >= N, f"the workload reached only {len(names)} probeable functions"
    kps = [Kprobe(symbol_name=n) for n in names[: 2 * N]] + [Kprobe(symbol_name="ksys_lseek")]
    before = target.text_snapshot({target.symbols.address(kp.symbol_name) for kp in kps if kp.symbol_name})
    target.register_kprobes(kps)
    try:
        # Keep N of the jump-optimized ones (ksys_lseek included): an int3 on a hot function would stop
        # the VM on every call.
        wait_for_optimizer(target)
        points = target.kprobes.points
        fast = [kp for kp in kps[:-1] if points[kp.resolved].opt is not None]
        assert points[kps[-1].resolved].opt is not None and len(fast) >= N - 1
        keep = [kps[-1], *fast[: N - 1]]
        kept = {id(kp) for kp in keep}
        target.unregister_kprobes([kp for kp in kps if id(kp) not in kept])
        assert len(target.kprobes.points) == N and all(kp.registered for kp in keep)
        assert target.list_probes().count("[OPTIMIZED]") == N
        hits_before = {id(kp): kp.nhit for kp in keep}
        res = workload_result(target.run("workload lseek 1000", timeout=600).check().output)
    finally:
        target.unregister_kprobes(kps)
    assert int(res["n"]) == 1000 and int(res["errors"]) == 0
    assert kps[-1].nhit - hits_before[id(kps[-1])] == 1000 and kps[-1].nmissed == 0
    # The workload's fork, exec and exit reach many of the others: their counters moved too.
    assert sum(kp.nhit > hits_before[id(kp)] for kp in keep) > N // 10
    assert not target.kprobes.points
    assert target.text_snapshot(before) == before
    assert not target.oopses()
