"""Data watchpoints (qprobe.core.watchpoint) on the toy target.

A hit is what the stop loop hands on: the handler Watchpoints registered in
``machine.watch_handlers`` for the watched address the stop reply names,
called with the vCPU's registers after the access.
"""

from __future__ import annotations

from typing import Any

import pytest
from fakearch import STACK, Toy, ToyTarget

from qprobe.core.handlers import Handlers
from qprobe.core.regs import PtRegs
from qprobe.core.watchpoint import Watchpoint, Watchpoints
from qprobe.errors import InvalidProbe, ProbeError
from qprobe.vmm.gdbremote import WATCH_ACCESS, WATCH_READ, WATCH_WRITE
from qprobe.vmm.memory import MemoryFault

A = "p1.1"
VAR = STACK + 0x100  # a watched variable


class Watched:
    def __init__(self) -> None:
        self.t = ToyTarget()
        self.t.symbols.markers["toy_var"] = VAR
        self.wps = Watchpoints(self.t.machine, self.t.symbols, Handlers(), self.make_regs)  # type: ignore[arg-type]

    def make_regs(self, values: dict[str, int], tid: str) -> PtRegs:
        return PtRegs(dict(values), tid, 0, self.t.mem, layout=Toy.registers)  # type: ignore[arg-type]

    def write(self, addr: int, data: bytes) -> None:
        """A vCPU writes ``data`` at ``addr``; QEMU reports the hit after the access, naming the watched address."""
        self.t.mem.write(addr, data)
        self.t.machine.watch_handlers[addr](A, dict(self.t.regs(A)))


@pytest.fixture
def w() -> Watched:
    return Watched()


def test_a_hit_counts_and_shows_the_values_before_and_after_the_access(w: Watched) -> None:
    seen: list[tuple[bytes, bytes, int]] = []

    def handler(wp: Watchpoint, regs: Any) -> None:
        seen.append((wp.old_value, wp.new_value, regs.ip))
        regs.r0 = 0x42  # written back before the vCPU goes on

    w.t.mem.write(VAR, (1).to_bytes(4, "little"))
    wp = Watchpoint("toy_var", length=4, handler=handler)
    w.wps.register_watchpoint(wp)
    assert (wp.registered, wp.resolved) == (True, VAR)
    assert w.t.cpu.breakpoints == [(VAR, WATCH_WRITE, 4)]
    w.t.regs(A)["pc"] = 0xFFFF_8000_0000_1004
    w.write(VAR, (2).to_bytes(4, "little"))
    w.write(VAR, (3).to_bytes(4, "little"))
    assert wp.nhit == 2
    assert seen == [
        (b"\1\0\0\0", b"\2\0\0\0", 0xFFFF_8000_0000_1004),
        (b"\2\0\0\0", b"\3\0\0\0", 0xFFFF_8000_0000_1004),
    ]
    assert w.t.regs(A)["r0"] == 0x42
    w.wps.unregister_watchpoint(wp)
    assert (wp.registered, w.t.cpu.breakpoints, w.t.machine.watch_handlers) == (False, [], {})


@pytest.mark.parametrize(("kind", "z"), [("w", WATCH_WRITE), ("r", WATCH_READ), ("rw", WATCH_ACCESS)])
def test_each_kind_is_its_gdbstub_watchpoint(w: Watched, kind: str, z: int) -> None:
    w.wps.register_watchpoint(Watchpoint(addr=VAR, offset=8, length=2, kind=kind))
    assert w.t.cpu.breakpoints == [(VAR + 8, z, 2)]


def test_a_failing_handler_is_counted_and_the_hit_goes_on(w: Watched) -> None:
    def boom(wp: Watchpoint, regs: Any) -> None:
        raise RuntimeError("oops")

    wp = Watchpoint(addr=VAR, handler=boom)
    w.wps.register_watchpoint(wp)
    w.write(VAR, b"\xff" * 8)
    assert (wp.nhit, wp.nfaults, wp.errors) == (1, 1, [f"handler of {wp!r} raised RuntimeError: oops"])


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ({"symbol_name": "toy_var", "addr": VAR}, "exactly one of symbol_name and addr"),
        ({"addr": VAR, "kind": "x"}, "kind 'x'"),
        ({"addr": VAR, "length": 0}, "length 0"),
        ({"addr": VAR, "length": 4097}, "length 4097"),
    ],
)
def test_bad_watchpoints_are_einval(args: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidProbe, match=words):
        Watchpoint(**args)


def test_an_unmapped_address_is_refused_before_the_stub_is_touched(w: Watched) -> None:
    wp = Watchpoint(addr=0xFFFF_9000_0000_0000)
    with pytest.raises(MemoryFault):
        w.wps.register_watchpoint(wp)
    assert (wp.registered, w.t.cpu.breakpoints, w.t.machine.watch_handlers) == (False, [], {})


def test_a_second_watchpoint_on_a_watched_address_is_refused_and_the_first_keeps_its_hits(w: Watched) -> None:
    first, second = [], []
    one = Watchpoint(addr=VAR, handler=lambda wp, regs: first.append(wp.new_value))
    w.wps.register_watchpoint(one)
    two = Watchpoint(addr=VAR, kind="rw", handler=lambda wp, regs: second.append(wp.new_value))
    with pytest.raises(ProbeError, match="already watched") as info:
        w.wps.register_watchpoint(two)
    assert "\n" not in str(info.value)
    assert two.registered is False
    w.write(VAR, b"\1" * 8)
    assert (first, second, one.nhit) == ([b"\1" * 8], [], 1)
    assert w.t.cpu.breakpoints == [(VAR, WATCH_WRITE, 8)]


def test_the_int3_hooks_own_watchpoint_cannot_be_taken_over(w: Watched) -> None:
    def hook(tid: str, regs: dict[str, int]) -> None:
        pass

    w.t.machine.watch_handlers[VAR] = hook  # the dispatcher's read watchpoint in the #BP handler
    with pytest.raises(ProbeError, match="already watched"):
        w.wps.register_watchpoint(Watchpoint(addr=VAR, kind="r"))
    assert w.t.machine.watch_handlers[VAR] is hook


def test_unregistering_a_watchpoint_that_is_not_registered_is_einval(w: Watched) -> None:
    wp = Watchpoint(addr=VAR)
    with pytest.raises(InvalidProbe, match="not registered"):
        w.wps.unregister_watchpoint(wp)
    w.wps.register_watchpoint(wp)
    w.wps.unregister_watchpoint(wp)
    with pytest.raises(InvalidProbe, match="not registered"):
        w.wps.unregister_watchpoint(wp)
    assert w.t.cpu.breakpoints == []
