"""Issue 4: watchpoint probes (QEMU's data watchpoints) on the real default image."""

from __future__ import annotations

import pytest

import qprobe
from qprobe import Watchpoint
from qprobe.errors import InvalidProbe, TargetError

pytestmark = pytest.mark.vm


def test_write_watchpoint_catches_sethostname(target: qprobe.Target) -> None:
    nodename = target.kernel.type_offset("struct uts_namespace", "name.nodename")
    where: list[str] = []
    wp = Watchpoint(symbol_name="init_uts_ns", offset=nodename, length=8,
                    handler=lambda w, regs: where.append(target.symbols.symbolize(regs.ip).split("+")[0]))  # fmt: skip
    target.register_watchpoint(wp)
    try:
        target.run("hostname watched1").check()
    finally:
        target.unregister_watchpoint(wp)
    assert wp.nhit >= 1 and where
    assert target.read(target.symbols.address("init_uts_ns") + nodename, 9) == b"watched1\0"
    # After removal, writes go unseen.
    hits = wp.nhit
    target.run("hostname qprobe").check()
    assert wp.nhit == hits
    assert target.oopses() == []


def test_bad_watchpoints() -> None:
    with pytest.raises(InvalidProbe):
        Watchpoint(symbol_name="jiffies", kind="x")
    with pytest.raises(InvalidProbe):
        Watchpoint()


def test_watchpoint_on_unmapped_memory_is_refused(target: qprobe.Target) -> None:
    with pytest.raises(TargetError, match="not mapped"):
        target.register_watchpoint(Watchpoint(addr=0xFFFF_FFFF_FFFF_0000 - 0x10000000))


def test_watchpoint_reports_every_change_with_old_and_new_values(target: qprobe.Target) -> None:
    domain = target.kernel.type_offset("struct uts_namespace", "name.domainname")
    changes: list[tuple[bytes, bytes]] = []
    wp = Watchpoint(symbol_name="init_uts_ns", offset=domain, length=8,
                    handler=lambda w, regs: changes.append((w.old_value, w.new_value)))  # fmt: skip
    target.register_watchpoint(wp)
    try:
        target.run("for i in 1 2 3 4 5; do echo dom$i > /proc/sys/kernel/domainname; done").check()
    finally:
        target.unregister_watchpoint(wp)
    values = [new.split(b"\0")[0] for old, new in changes if old != new]
    assert values == [b"dom1", b"dom2", b"dom3", b"dom4", b"dom5"], changes
