"""Typed kernel data through drgn over live guest memory: current, globals, drgn's helpers."""

from __future__ import annotations

import pytest

import qprobe
from qprobe import Kprobe
from qprobe.errors import SymbolError

from .conftest import workload_result

pytestmark = pytest.mark.vm


def test_current_task_members_in_a_handler(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    seen: list[tuple[str, int, int, int, str]] = []

    def pre(kp: Kprobe, regs: qprobe.PtRegs) -> None:
        cur = target.current(regs)
        seen.append((cur.comm.string_().decode(), cur.pid.value_(), cur.tgid.value_(), cur.mm.start_brk.value_(),
                     cur.real_parent.comm.string_().decode()))  # fmt: skip

    kp = Kprobe(symbol_name="ksys_lseek", pre_handler=pre)
    target.register_kprobe(kp)
    try:
        res = workload_result(target.run("workload lseek 2").check().output)
    finally:
        target.unregister_kprobe(kp)
    pid = int(res["pid"])
    assert len(seen) == 2
    for comm, tpid, tgid, brk, parent in seen:
        assert (comm, tpid, tgid, parent) == ("workload", pid, pid, "sh") and brk > 0


def test_global_variables(target: qprobe.Target) -> None:
    init = target.var("init_task")
    assert init.comm.string_() == b"swapper/0" and init.pid.value_() == 0
    jiffies = target.var("jiffies")
    first = jiffies.value_()
    target.run("sleep 0.2").check()
    assert jiffies.value_() > first  # a reference object: every value_() reads the guest again
    uts = target.var("init_uts_ns")
    assert uts.name.sysname.string_() == b"Linux"
    release = target.run("uname -r").check().output.strip()
    assert uts.name.release.string_().decode() == release
    with pytest.raises(SymbolError, match="no kernel variable 'no_such_variable'"):
        target.var("no_such_variable")
    with pytest.raises(AttributeError, match="no member"):
        _ = init.no_such_member
