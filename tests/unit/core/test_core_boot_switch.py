"""Boot-time probes move from stub breakpoints to the int3 path once boot is done (KprobeManager.switch_from_boot).

While ``booting``, a probe not asked ``anywhere=True`` goes on a stub breakpoint, marked ``boot_stub``;
the switch moves those the int3 path accepts, in one stop, keeping the Kprobe objects and their counts,
and no hit is missed or counted twice: a vCPU stopped on the probed address takes the int3, and one
stopped past a stub whose probe the int3 path arms further on (an ``__fentry__`` site) is not counted again.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fakearch import BRK_OP, ENTRY, Rig

from qprobe.core.kprobe import KPROBE_FLAG_GONE, Kprobe, Kretprobe
from qprobe.core.kretprobe import KretprobeManager
from qprobe.core.listing import list_probes
from qprobe.errors import InvalidProbe
from qprobe.vmm.gdbremote import BREAK_HW

A, B = "p1.1", "p1.2"


@pytest.fixture
def rig() -> Rig:
    rig = Rig()
    rig.km.booting = True
    return rig


def _stub_hit(rig: Rig, tid: str, addr: int) -> None:
    """The VM stopped with ``tid`` on a stub breakpoint at ``addr``: what the stop loop does."""
    cpu = rig.t.regs(tid)
    cpu["pc"] = addr
    rig.t.machine.stop_handlers[addr](tid, dict(cpu))


def _switch(rig: Rig) -> list[int]:
    return rig.t.machine.call(rig.km.switch_from_boot)


def test_a_boot_probe_moves_to_the_int3_path_with_its_count_and_an_explicit_anywhere_one_stays(rig: Rig) -> None:
    addr, other = rig.fn + 4, rig.other
    boot = Kprobe("toy_fn", offset=4)
    explicit = Kprobe("toy_other", anywhere=True)
    rig.km.register_kprobe(boot)
    rig.km.register_kprobe(explicit)
    assert boot.anywhere and boot.boot_stub and not explicit.boot_stub
    assert rig.text_unchanged() and (addr, BREAK_HW, 1) in rig.t.cpu.breakpoints
    assert list_probes(rig.km).count("[ANYWHERE]") == 2
    _stub_hit(rig, A, addr)
    assert boot.nhit == 1

    assert _switch(rig) == [addr]
    assert not rig.km.booting and not boot.anywhere and not boot.boot_stub and boot.registered
    assert rig.t.mem.read(addr, 1)[0] == BRK_OP and addr in rig.km.points and addr not in rig.km.stubs.points
    assert (addr, BREAK_HW, 1) not in rig.t.cpu.breakpoints and (other, BREAK_HW, 1) in rig.t.cpu.breakpoints
    lines = list_probes(rig.km).splitlines()
    assert [line for line in lines if "toy_fn" in line] == [f"{addr:016x}  k  toy_fn+0x4"]
    assert [line for line in lines if "[ANYWHERE]" in line] == [f"{other:016x}  k  toy_other+0x0    [ANYWHERE]"]

    rig.run(A, addr)  # now an int3 hit
    assert boot.nhit == 2 and rig.t.regs(A)["pc"] == addr + 4
    # A probe registered after boot is an int3 one; both unregister as their mechanism wants.
    later = Kprobe("toy_fn", offset=8)
    rig.km.register_kprobe(later)
    assert not later.anywhere and not later.boot_stub
    rig.km.unregister_kprobes([boot, explicit, later])
    assert rig.text_unchanged() and rig.t.cpu.breakpoints == []


def test_a_vcpu_stopped_on_the_address_at_the_switch_is_counted_once(rig: Rig) -> None:
    addr = rig.fn + 4
    kp = Kprobe("toy_fn", offset=4)
    rig.km.register_kprobe(kp)
    rig.t.regs(B)["pc"] = addr  # stopped there, its stub hit not taken: it has not run the instruction
    _switch(rig)
    assert rig.t.regs(B)["pc"] == addr and rig.t.cpu.steps == []
    rig.step(B)  # the int3
    assert kp.nhit == 1 and rig.t.regs(B)["pc"] == addr + 4


def test_past_a_stub_whose_int3_goes_on_the_next_instruction_a_hit_is_not_counted_twice(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An __fentry__ site: a stub breakpoint on it, the int3 on the instruction after it (ProbeSites.arming_address).
    site = rig.fn + 4
    monkeypatch.setattr(rig.km.sites, "arming_address", lambda kp: kp.at if kp.anywhere else kp.at + 4)
    kp = Kprobe("toy_fn", offset=4)
    rig.km.register_kprobe(kp)
    assert kp.resolved == site
    _stub_hit(rig, A, site)  # counted at the stub, A stepped past it: on the int3's address-to-be
    assert kp.nhit == 1 and rig.t.regs(A)["pc"] == site + 4
    rig.t.regs(B)["pc"] = site  # not run yet
    r0 = rig.t.regs(A)["r0"]

    assert _switch(rig) == [site + 4]
    assert rig.t.mem.read(site + 4, 1)[0] == BRK_OP and kp.resolved == site + 4
    assert rig.t.regs(A)["pc"] == site + 8 and rig.t.regs(A)["r0"] == r0 + 5  # its ADDI ran, once, uncounted
    rig.step(A)
    rig.step(B)  # the NOP on the old site
    rig.step(B)  # the int3
    assert kp.nhit == 2
    rig.km.unregister_kprobe(kp)
    assert rig.text_unchanged()


def test_what_the_int3_path_refuses_stays_on_its_stub(rig: Rig) -> None:
    blacklisted = Kprobe(addr=ENTRY + 4)  # entry text
    reserved = Kprobe("toy_fn", offset=8)
    gone = Kprobe("toy_other")
    for kp in (blacklisted, reserved, gone):
        rig.km.register_kprobe(kp)
        assert kp.boot_stub
    # A jump-label site (the kernel rewrites it at run time: check_kprobe_address_safe refuses it).
    rig.km.sites.__dict__["reserved"] = SimpleNamespace(
        conflict=lambda start, end: "jump label" if start == rig.fn + 8 else None
    )
    gone.flags |= KPROBE_FLAG_GONE  # retired with freed __init text
    rig.km.stubs.sync(rig.km.stubs.points[rig.other])

    assert _switch(rig) == []
    for kp in (blacklisted, reserved, gone):
        assert kp.anywhere and kp.registered and kp.resolved in rig.km.stubs.points
    assert rig.text_unchanged() and not rig.km.points
    assert {(ENTRY + 4, BREAK_HW, 1), (rig.fn + 8, BREAK_HW, 1)} == set(rig.t.cpu.breakpoints)
    assert list_probes(rig.km).count("[ANYWHERE]") == 3
    _stub_hit(rig, A, rig.fn + 8)
    assert reserved.nhit == 1


def test_a_probe_refused_while_booting_is_left_as_given(rig: Rig) -> None:
    kp = Kprobe("toy_fn", offset=2)  # not an instruction boundary
    with pytest.raises(InvalidProbe):
        rig.km.register_kprobe(kp)
    assert not kp.anywhere and not kp.boot_stub and not kp.registered


def test_a_kretprobe_armed_while_booting_stays_on_stub_breakpoints(rig: Rig) -> None:
    rpm = KretprobeManager(rig.km)
    rp = Kretprobe("toy_other")
    rpm.register_kretprobe(rp)
    assert rp.kp.anywhere and not rp.kp.boot_stub and rp in rpm.stub_of
    assert _switch(rig) == []
    assert rp.kp.anywhere and rp.kp.resolved in rig.km.stubs.points and rig.text_unchanged()
    rpm.unregister_kretprobe(rp)


def test_two_boot_probes_on_one_address_move_together(rig: Rig) -> None:
    addr = rig.fn + 4
    first, second = Kprobe("toy_fn", offset=4), Kprobe("toy_fn", offset=4)
    rig.km.register_kprobes([first, second])
    _stub_hit(rig, A, addr)
    assert first.nhit == second.nhit == 1

    assert _switch(rig) == [addr]
    assert not first.anywhere and not second.anywhere and addr in rig.km.points and not rig.km.stubs.points
    assert (addr, BREAK_HW, 1) not in rig.t.cpu.breakpoints
    rig.run(A, addr)
    assert first.nhit == second.nhit == 2


def test_a_boot_probe_registered_again_after_boot_goes_on_the_int3_path(rig: Rig) -> None:
    addr = rig.fn + 4
    kp = Kprobe("toy_fn", offset=4)
    rig.km.register_kprobe(kp)
    rig.km.unregister_kprobe(kp)  # during boot, as a module's event is killed with its text
    _switch(rig)
    rig.km.register_kprobe(kp)
    assert not kp.anywhere and not kp.boot_stub and addr in rig.km.points and not rig.km.stubs.points
    assert rig.t.mem.read(addr, 1)[0] == BRK_OP
