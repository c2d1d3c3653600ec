"""The shell's uprobe lines on a fake target: uprobe_events, perf -x and bpftrace forms, listing, counting."""

from __future__ import annotations

from shell_fakes import make_shell

from qprobe.core.uprobe import Uprobe
from qprobe.events.fold import fold_path
from qprobe.shell.collect import Aggregation, Collector
from qprobe.shell.parse import is_bpftrace_uprobe, is_definition


def run(shell, out, line: str) -> list[str]:  # type: ignore[no-untyped-def]
    out.seek(0)
    out.truncate()
    shell.execute(line)
    return out.getvalue().splitlines()


def test_uprobe_lines_are_added_listed_and_removed() -> None:
    shell, t, out = make_shell()
    assert run(shell, out, "p:uq /bin/uprog:qpt_target a=%di s=+0(%dx):string") == [
        "added uprobes/uq  (user-space probe on /bin/uprog:0x0000000000001a50 (qpt_target) with a s)"
    ]
    assert run(shell, out, "r:uqr /bin/uprog:qpt_target ret=$retval:s64")[0].startswith(
        "added uprobes/uqr  (user-space return probe"
    )
    assert isinstance(t.events["uprobes/uq"].probe, Uprobe)
    # As the kernel's uprobe_events lists them (trace_uprobe_show): the offset as 0x%016lx.
    assert run(shell, out, "events") == [
        "p:uprobes/uq /bin/uprog:0x0000000000001a50 a=%di s=+0(%dx):string",
        "r:uprobes/uqr /bin/uprog:0x0000000000001a50 ret=$retval:s64",
    ]
    assert run(shell, out, "p:uq /bin/uprog:0x1a50") == [
        "p:uq /bin/uprog:0x1a50",
        "  ^ Given group/event name is already used by another event",
    ]
    assert run(shell, out, "-:uq") == ["removed uprobes/uq (0 hits)"]
    assert run(shell, out, "-:uprobes/uqr") == ["removed uprobes/uqr (0 hits)"]
    assert t.events == {}


def test_a_bad_uprobe_line_gets_the_kernels_caret() -> None:
    shell, t, out = make_shell()
    assert run(shell, out, "p:uq /bin/uprog:0x1a50 a=%zz") == [
        "p:uq /bin/uprog:0x1a50 a=%zz",
        " " * 25 + "^ Invalid register name",
    ]
    assert run(shell, out, "p:uq /bin/uprog:nope")[0].startswith("error: /bin/uprog has no function 'nope'")
    assert not t.events


def test_perf_x_and_bpftrace_forms_say_the_line_they_write() -> None:
    shell, t, out = make_shell()
    assert run(shell, out, "perf -x /bin/uprog qpt_target a=%di") == [
        "writing event: p:probe_uprog/qpt_target /bin/uprog:0x1a50 a=%di",
        "added probe_uprog/qpt_target  (user-space probe on /bin/uprog:0x0000000000001a50 (qpt_target) with a)",
    ]
    assert run(shell, out, "uretprobe:/bin/uprog:qpt_target retval")[0] == (
        "writing event: r:uprobes/qpt_target__return /bin/uprog:0x1a50 retval=$retval:u64"
    )
    assert run(shell, out, "uprobe:/bin/uprog:qpt_target retval") == [
        "error: retval: bpftrace has it in uretprobes only"
    ]
    assert sorted(t.events) == ["probe_uprog/qpt_target", "uprobes/qpt_target__return"]


def test_uprobe_forms_are_recognised() -> None:
    assert is_definition("p:uq /bin/uprog:qpt_target a=%di")
    assert is_bpftrace_uprobe("uprobe:/bin/uprog:qpt_target arg0")
    assert is_bpftrace_uprobe("uretprobe:/usr/lib/libqpt.so:qpt_lib_add")
    assert not is_bpftrace_uprobe("uprobes")
    assert not is_bpftrace_uprobe("count uq by $comm")


def test_uprobe_hits_are_counted_on_the_host() -> None:
    """No in-guest count for a uprobe event: its probe counts nothing in the guest, every hit reaches the tap."""
    shell, t, out = make_shell()
    run(shell, out, "p:uq /bin/uprog:qpt_target a=%di")
    te = t.events["uprobes/uq"]
    agg = Aggregation("count", ())
    assert fold_path([te], "count", (), None) == "ring"
    with Collector([te], agg) as c:
        assert c.path == "ring" and not c.in_guest
        for _ in range(3):
            t.fire(te, comm="uprog", pid=7, a="0x1")
    assert agg.render() == "@: 3\n"
    by_comm = Aggregation("count", ("$comm",))
    with Collector([te], by_comm):
        t.fire(te, comm="uprog", pid=7, a="0x1")
        t.fire(te, comm="uprog", pid=8, a="0x2")
    assert by_comm.render() == "@[uprog]: 2\n"


def test_stack_of_a_uprobe_event_is_refused() -> None:
    shell, _t, out = make_shell()
    run(shell, out, "p:uq /bin/uprog:qpt_target a=%di")
    assert run(shell, out, "count uq by $stack for 0.01") == [
        "error: $stack is the kernel's stack; uprobes/uq probes user space"
    ]


def test_enable_disable_a_uprobe_event_is_refused() -> None:
    shell, _t, out = make_shell()
    run(shell, out, "p:uq /bin/uprog:qpt_target")
    assert run(shell, out, "disable uq") == [
        "error: uprobes/uq: a uprobe event is armed while it exists (-:uprobes/uq removes it)"
    ]


def test_a_misspelt_perf_function_gets_the_closest_names_before_any_dwarf() -> None:
    """The shell's perf probe goes through the CLI's front end: a typo is said as a kprobe_events one is."""
    shell, t, out = make_shell()
    assert run(shell, out, "perf vfs_raed count") == [
        "error: no symbol 'vfs_raed' in vmlinux (did you mean vfs_read, vfs_readv?)"
    ]
    assert not t.events
