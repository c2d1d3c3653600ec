"""Why a point's jump must wait (qprobe.core.optcheck.JumpCheck), on the toy architecture.

A real KprobeManager on the toy target (tests/unit/core/fakearch.py) holds
the probes; the toy is given jump optimization whose check passes, displacing two
instructions, so that what is checked here is what the core adds: the
probes, boosted copies, vCPUs and interrupted contexts around the region.
The vCPUs are given as the round's view (``RoundView``), as a round reads
them once for every point it checks.
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
from fakearch import BRK, STACK, USER, Rig

from qprobe.core.kprobe import Kprobe
from qprobe.core.optcheck import RoundView, VcpuView, transient
from qprobe.core.point import ProbePoint
from qprobe.core.text import KernelText

REGION = 8  # bytes the toy jump displaces here: two instructions
STACK_BYTES = 0x4000
A, B = "p1.1", "p1.2"


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch) -> Rig:
    r = Rig()
    opt = SimpleNamespace(jump_size=8, arch_check_optimized_kprobe=lambda *args: (None, REGION))
    monkeypatch.setattr(r.km.arch, "optprobes", opt)  # the toy has no jump optimization of its own
    # THREAD_SIZE from the linker script's init stack (the toy kernel has no debug info).
    r.t.symbols.markers.update({"__start_init_stack": STACK, "__end_init_stack": STACK + STACK_BYTES})
    return r


def probe(rig: Rig, offset: int) -> ProbePoint:
    kp = Kprobe("toy_fn", offset=offset)
    rig.km.register_kprobe(kp, optimize=False)
    return rig.km.points[kp.resolved]


def view(rig: Rig, *vcpus: VcpuView) -> None:
    """The round's view: these vCPUs, the table's probes and resume targets as they are now."""
    rig.km.optimizer.check.round = RoundView(list(vcpus), rig.km.addresses(), sorted(rig.km.slots.resume_targets))


def idle(tid: str = A) -> VcpuView:
    return VcpuView(tid, 0, None, [])  # in user mode: nothing of it in kernel text


def why(rig: Rig, point: ProbePoint) -> str | None:
    return rig.km.optimizer.check.why_not(point)


def test_a_free_region_may_take_the_jump_and_its_size_is_kept(rig: Rig) -> None:
    point = probe(rig, 4)
    view(rig, idle(A), idle(B))
    assert why(rig, point) is None
    assert point.opt_size == REGION


def test_another_probe_in_the_region_is_no_moment_s_obstacle(rig: Rig) -> None:
    point, _ = probe(rig, 4), probe(rig, 8)
    view(rig, idle(A), idle(B))
    reason = why(rig, point)
    assert reason == "another probe lies in the region" and not transient(reason)


@pytest.mark.parametrize(
    ("vcpu", "start"),
    [
        (lambda at: VcpuView(A, at + 4, None, []), f"vCPU {A} is inside the region"),
        (lambda at: VcpuView(A, 0, at + 4, []), f"vCPU {A} is trapping on an int3 inside the region"),
        (lambda at: VcpuView(A, 0, None, [1, at + 4]), f"a context interrupted on vCPU {A} would return inside"),
        (lambda at: VcpuView(A, 0, None, None), f"a context interrupted on vCPU {A} would return inside"),
    ],
    ids=["ip", "trapping", "interrupted", "stacks unreadable"],
)  # fmt: skip
def test_a_vcpu_that_could_still_run_the_region_delays_the_jump(rig: Rig, vcpu: object, start: str) -> None:
    point = probe(rig, 4)
    view(rig, idle(B), vcpu(point.addr))  # type: ignore[operator]
    reason = why(rig, point)
    assert reason is not None and reason.startswith(start) and transient(reason)


def test_a_vcpu_at_the_probed_instruction_itself_does_not_delay_the_jump(rig: Rig) -> None:
    point = probe(rig, 4)
    view(rig, VcpuView(A, point.addr, point.addr, [point.addr]), idle(B))  # the jump replaces the int3 there
    assert why(rig, point) is None


def test_a_boosted_copy_returning_into_the_region_delays_a_detour_s_return_refuses(rig: Rig) -> None:
    point = probe(rig, 4)
    rig.km.slots.resume_targets[point.addr + 4] = time.monotonic()  # a boosted copy jumped back there just now
    view(rig, idle(A), idle(B))
    reason = why(rig, point)
    assert reason is not None and reason.startswith("a boosted copy returning into the region") and transient(reason)
    rig.km.slots.resume_targets[point.addr + 4] = math.inf  # a detour jumps back there
    reason = why(rig, point)
    assert reason == "out-of-line code returns into the region" and not transient(reason)


def test_a_kernel_that_does_not_tell_its_stack_size_keeps_the_int3(rig: Rig) -> None:
    del rig.t.symbols.markers["__start_init_stack"]
    point = probe(rig, 4)
    view(rig, idle(A), idle(B))
    reason = why(rig, point)
    assert reason is not None and reason.startswith("interrupted contexts cannot be found") and not transient(reason)


def test_a_round_reads_the_vcpus_once_for_all_its_points(rig: Rig) -> None:
    first, second = probe(rig, 4), probe(rig, 12)
    for tid in (A, B):
        rig.t.regs(tid).update(pc=0, psr=USER)  # user mode: no kernel stack to read
    check = rig.km.optimizer.check
    check.begin_round()
    assert why(rig, first) is None
    rig.t.regs(A)["pc"] = second.addr + 4  # moves after the round read it: this round does not see it
    assert why(rig, second) is None
    check.begin_round()  # the next round (the VM ran in between)
    reason = why(rig, second)
    assert reason == f"vCPU {A} is inside the region"


def test_kernel_text_keeps_the_original_bytes_under_every_write(rig: Rig) -> None:
    text, at = KernelText(rig.t.machine), rig.fn + 4
    before = rig.t.mem.read(at, 12)
    p = text.patch(at, BRK, "int3")
    assert rig.t.mem.read(at, 4) == BRK and text.original(at, 12) == before
    jmp = text.repatch(p, BRK * 2, "optjmp")  # an int3 swapped for a longer jump
    assert dict(text.patched()) == {at + i: b for i, b in enumerate(before[:8])}
    assert text.original(at, 12) == before
    text.unpatch(jmp)
    assert rig.t.mem.read(at, 12) == before and dict(text.patched()) == {}
