"""Issue 4: typed kernel data (BTF) over live guest memory."""

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
        seen.append((cur.comm.string_(), cur.pid.value_(), cur.tgid.value_(), cur.mm.start_brk.value_(),
                     cur.real_parent.comm.string_()))  # fmt: skip

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
    init = target.var("init_task", "struct task_struct")
    assert init.comm.string_() == "swapper/0" and init.pid.value_() == 0
    jiffies = target.var("jiffies", "unsigned long")
    first = jiffies.value_()
    target.run("sleep 0.2").check()
    assert jiffies.value_() > first
    uts = target.var("init_uts_ns", "struct uts_namespace")
    assert uts.name.sysname.string_() == "Linux"
    with pytest.raises(SymbolError, match="give the C type"):
        target.var("jiffies")
    with pytest.raises(AttributeError, match="no member"):
        _ = init.no_such_member
