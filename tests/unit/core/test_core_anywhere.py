"""Probes on the gdbstub's own breakpoints (qprobe.core.anywhere) on the toy architecture.

Nothing is written into the text, the blacklist is no bar, a hit runs the
handlers and then the instruction in place (a host single-step), and the
breakpoint goes when its last probe does.
"""

from __future__ import annotations

import pytest
from fakearch import ADDI, ENTRY, NOP, Rig

from qprobe.core.kprobe import Kprobe
from qprobe.core.listing import list_probes
from qprobe.errors import Blacklisted, InvalidProbe
from qprobe.vmm.gdbremote import BREAK_HW

A = "p1.1"


@pytest.fixture
def rig() -> Rig:
    return Rig()


def _hit(rig: Rig, addr: int, **regs: int) -> dict[str, int]:
    """The VM stopped with vCPU A on ``addr`` (a stub breakpoint there): what the stop loop does."""
    cpu = rig.t.regs(A)
    cpu.update(pc=addr, **regs)
    rig.t.machine.stop_handlers[addr](A, dict(cpu))
    return rig.t.regs(A)


def after_hit(rig: Rig, addr: int) -> int:
    return _hit(rig, addr)["pc"]


def test_a_blacklisted_instruction_is_probed_without_a_write(rig: Rig) -> None:
    with pytest.raises(Blacklisted):
        rig.km.register_kprobe(Kprobe(addr=ENTRY + 4))
    seen: list[tuple[int, int]] = []
    kp = Kprobe(addr=ENTRY + 4, anywhere=True, pre_handler=lambda k, regs: seen.append((regs.ip, regs.r0)) or 0,
                post_handler=lambda k, regs: seen.append((regs.ip, regs.r0)))  # fmt: skip
    rig.km.register_kprobe(kp)
    assert rig.text_unchanged() and (ENTRY + 4, BREAK_HW, 1) in rig.t.cpu.breakpoints
    assert "[ANYWHERE]" in list_probes(rig.km)
    after = _hit(rig, ENTRY + 4, r0=1)
    # The handler before the instruction, the instruction performed (a NOP, by the host), the post_handler after it.
    assert seen == [(ENTRY + 4, 1), (ENTRY + 8, 1)] and after["pc"] == ENTRY + 8
    assert kp.nhit == 1 and rig.t.cpu.steps == []
    rig.km.unregister_kprobe(kp)
    assert rig.t.cpu.breakpoints == [] and ENTRY + 4 not in rig.t.machine.stop_handlers and rig.text_unchanged()


def test_an_instruction_the_arch_emulates_is_not_stepped_and_any_other_is_stepped_where_it_is(rig: Rig) -> None:
    """A step's stop costs QEMU a flush of all its translated code: a hit on an instruction the host can
    perform (the toy's NOP) makes none; the ADDI beside it runs in place, stepped."""
    nop, addi = rig.fn + 4, rig.fn + 8
    assert (rig.t.mem.read(nop, 1)[0], rig.t.mem.read(addi, 1)[0]) == (NOP, ADDI)
    seen: list[tuple[int, int]] = []
    for addr in (nop, addi):
        rig.km.register_kprobe(Kprobe(addr=addr, anywhere=True, post_handler=lambda k, r: seen.append((r.ip, r.r0))))
    assert _hit(rig, nop, r0=1)["pc"] == nop + 4 and rig.t.cpu.steps == []
    after = _hit(rig, addi, r0=10)
    assert rig.t.cpu.steps == [(A, addi)] and after["pc"] == addi + 4 and after["r0"] == 15  # ADDI 5, run
    assert seen == [(nop + 4, 1), (addi + 4, 15)]
    assert [(p.emulated, p.steps) for p in rig.km.stubs.points.values()] == [(1, 0), (0, 1)]


def test_a_pre_handler_that_moves_ip_skips_the_instruction(rig: Rig) -> None:
    addr = rig.fn + 8  # ADDI 5

    def skip(kp: Kprobe, regs: object) -> int:
        regs.ip += 4  # type: ignore[attr-defined]
        return 1

    rig.km.register_kprobe(Kprobe(addr=addr, anywhere=True, pre_handler=skip))
    after = _hit(rig, addr, r0=10)
    assert rig.t.mem.read(addr, 1)[0] == ADDI
    assert after["pc"] == addr + 4 and after["r0"] == 10 and rig.t.cpu.steps == []  # the ADDI never ran


def test_a_disabled_probe_has_no_breakpoint_and_an_int3_probe_cannot_share_the_address(rig: Rig) -> None:
    addr = rig.fn + 4  # NOP
    assert rig.t.mem.read(addr, 1)[0] == NOP
    kp = Kprobe(addr=addr, anywhere=True, disabled=True)
    rig.km.register_kprobe(kp)
    assert rig.t.cpu.breakpoints == [] and addr not in rig.t.machine.stop_handlers  # disabled: costs nothing
    rig.km.enable_kprobe(kp)
    assert after_hit(rig, addr) == addr + 4 and kp.nhit == 1
    rig.km.set_enabled(False)
    assert rig.t.cpu.breakpoints == []
    rig.km.set_enabled(True)
    assert rig.t.cpu.breakpoints == [(addr, BREAK_HW, 1)]
    with pytest.raises(InvalidProbe, match="EBUSY"):
        rig.km.register_kprobe(Kprobe(addr=addr))
    rig.km.unregister_kprobe(kp)
    plain = Kprobe(addr=addr)
    rig.km.register_kprobe(plain)
    with pytest.raises(InvalidProbe, match="EBUSY"):
        rig.km.register_kprobe(Kprobe(addr=addr, anywhere=True))
    rig.km.unregister_kprobe(plain)
    assert rig.text_unchanged()
