"""Shell.execute on a fake target: every command's output and every error as one line."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
from shell_fakes import BANNER, FakeTarget, make_shell

from qprobe.errors import TargetError
from qprobe.shell import Shell
from qprobe.shell.collect import stack_unwinder


def lines(out) -> list[str]:  # type: ignore[no-untyped-def]
    return out.getvalue().splitlines()


def run(shell: Shell, out, line: str) -> list[str]:  # type: ignore[no-untyped-def]
    out.seek(0)
    out.truncate()
    shell.execute(line)
    return lines(out)


def test_add_list_events_and_remove() -> None:
    shell, t, out = make_shell()
    assert run(shell, out, "p:myread vfs_read count=%dx:u64") == [
        "added kprobes/myread  (probe on vfs_read with count)"
    ]
    assert run(shell, out, "r:ret ksys_read ret=$retval:s64")[0].startswith("added kprobes/ret  (return probe")
    assert run(shell, out, "p vfs_write")[0].startswith("added kprobes/p_vfs_write_0")
    assert run(shell, out, "events") == [
        "p:kprobes/myread vfs_read count=%dx:u64",
        "r:kprobes/ret ksys_read ret=$retval:s64",
        "p:kprobes/p_vfs_write_0 vfs_write",
    ]
    assert len(run(shell, out, "list")) == 3
    assert run(shell, out, "-:myread") == ["removed kprobes/myread (0 hits)"]
    assert run(shell, out, "-:kprobes/") == ["removed kprobes/ret (0 hits)", "removed kprobes/p_vfs_write_0 (0 hits)"]
    assert t.events == {}
    assert run(shell, out, "-:myread") == ["error: no event matches '-:myread' (ENOENT)"]


def test_bad_definition_prints_the_caret_and_the_shell_goes_on() -> None:
    shell, t, out = make_shell()
    assert run(shell, out, "p:bad vfs_read x=%zz") == ["p:bad vfs_read x=%zz", " " * 17 + "^ Invalid register name"]
    assert run(shell, out, "p:bad no_such_function") == [
        "p:bad no_such_function",
        " " * 6 + "^ Invalid probed address or symbol",
    ]
    assert not t.events and not shell.done
    run(shell, out, "p:gp __x64_sys_getppid")
    assert run(shell, out, "p:gp vfs_read") == [
        "p:gp vfs_read",
        "  ^ Given group/event name is already used by another event",
    ]


def test_interactive_caret_goes_under_the_typed_line() -> None:
    shell, _t, out = make_shell()
    shell.interactive = True
    assert run(shell, out, "  p:bad vfs_read x=%zz") == [" " * (8 + 2 + 17) + "^ Invalid register name"]


def test_errors_are_one_line() -> None:
    shell, _t, out = make_shell()
    for line, want in [
        ("frobnicate", "error: unknown command 'frobnicate'; `help` lists them"),
        ("enabled 2", "error: usage: enabled [0|1]"),
        ("hist", "error: usage: hist EVENT by KEY [for SECONDS | run CMD]"),
        ("count gp by", "error: count: by needs a KEY"),
        (
            "count gp by $foo",
            "error: count: unknown key '$foo': an argument name, $comm, $pid, $cpu, $func, $event, $stack",
        ),
        ("count", "error: no events yet: add one, e.g.  p:myread vfs_read count=%dx:u64"),
        ("show for soon", "error: a duration is SECONDS (5, 0.5, 100ms, 2m), not 'soon'"),
        ("sym no_such_symbol", "error: unknown symbol 'no_such_symbol' in vmlinux"),
        ("x no_such_symbol", "error: unknown symbol 'no_such_symbol' in vmlinux"),
        ("x 0x1234 16", "error: cannot read 0x1234: not mapped"),
        ("x linux_banner 0", "error: LEN must be 1..1048576, not 0"),
        ("regs 7", "error: CPU must be 0..1, not 7"),
        ("run", "error: usage: run CMD"),
        ("load /no/such/file.py", "error: load: cannot read /no/such/file.py: No such file or directory"),
        ("help nope", "error: no command 'nope'; `help` lists them"),
    ]:
        assert run(shell, out, line) == [want], line
    assert run(shell, out, "rgs")[0].startswith("error: unknown command 'rgs' (did you mean regs?)")
    assert not shell.done


def test_a_multi_line_error_is_printed_on_one_line() -> None:
    shell, t, out = make_shell()

    def fail(command: str, timeout: float = 60.0) -> None:
        raise TargetError("guest command 'x' failed:\nline one\n\nline two")

    t.run = fail  # type: ignore[method-assign]
    assert run(shell, out, "run x") == ["error: guest command 'x' failed: | line one | line two"]


def test_comments_and_blank_lines_do_nothing() -> None:
    shell, _t, out = make_shell()
    assert run(shell, out, "") == [] and run(shell, out, "   # a comment") == []


def test_enable_disable_and_global_knob() -> None:
    shell, t, out = make_shell()
    run(shell, out, "p:a vfs_read")
    run(shell, out, "p:b vfs_write")
    assert run(shell, out, "disable *") == ["kprobes/a disabled", "kprobes/b disabled"]
    assert all(te.probe.disabled for te in t.events.values())  # type: ignore[union-attr]
    assert run(shell, out, "enable b") == ["kprobes/b enabled"]
    assert run(shell, out, "enable zz") == ["error: no such event 'zz' (ENOENT); `events` lists them"]
    assert run(shell, out, "enabled 0") == [] and t.enabled_calls == [False]
    assert run(shell, out, "enabled") == ["0"]


def test_optimization_sets_the_knob_or_says_why_it_cannot() -> None:
    shell, t, out = make_shell()
    assert run(shell, out, "optimization 0") == [] and run(shell, out, "optimization 1") == []
    assert t.optimization_calls == [False, True]
    assert run(shell, out, "optimization") == ["error: usage: optimization 0|1"]
    t.optimizable = False
    assert run(shell, out, "optimization 1") == [
        "error: jump optimization needs qprobe's own QEMU (a doorbell device and shared RAM)"
    ]


def test_count_over_a_guest_command() -> None:
    shell, t, out = make_shell()
    run(shell, out, "p:gp __x64_sys_getppid")
    got = run(shell, out, "count gp by $comm run workload getppid 5")
    assert got == ["workload mode=getppid n=5 pid=42 ret=1 errors=0", "exit status 0", "@[workload]: 5"]
    assert run(shell, out, "count gp run workload getppid 2")[-1] == "@: 2"
    assert run(shell, out, "count gp by $pid run workload getppid 3")[-1] == "@[42]: 3"
    assert run(shell, out, "count() gp by $comm run workload getppid 4")[-1] == "@[workload]: 4"  # bpftrace's
    assert t.events["kprobes/gp"].callback is None  # the tap is gone


def test_a_count_over_an_interrupted_command_gets_the_hits_still_in_the_guest() -> None:
    """Ctrl-C in the guest command: the record rings are drained before the map prints, as run() does."""
    shell, t, out = make_shell()
    run(shell, out, "p:gp __x64_sys_getppid")
    got = run(shell, out, "count gp by $comm run interrupted 4")
    assert got == ["", "interrupted: sent ^C to the guest command", "@[workload]: 4"]
    assert t.interrupts == 1


class _CtrlCWhenShown(io.StringIO):
    """Output where Ctrl-C is typed the moment the line saying to type it shows."""

    typed = False

    def write(self, s: str) -> int:
        n = super().write(s)
        if "Ctrl-C to stop" in s and not self.typed:
            self.typed = True
            raise KeyboardInterrupt
        return n


def test_a_ctrl_c_as_soon_as_the_count_says_so_ends_the_count() -> None:
    t = FakeTarget()
    out = _CtrlCWhenShown()
    shell = Shell(t, out=out)  # type: ignore[arg-type]
    shell.execute("p:gp __x64_sys_getppid")
    shell.execute("count gp by $comm")
    assert out.typed and lines(out)[-3:] == ["counting kprobes/gp by $comm; Ctrl-C to stop", "", "no hits"]
    assert t.events["kprobes/gp"].callback is None  # the tap is gone


def test_count_prints_what_it_lost() -> None:
    """Hits dropped on a full record ring are in nmissed: the result says how many it is short."""
    shell, _t, out = make_shell()
    run(shell, out, "p:gp __x64_sys_getppid")
    got = run(shell, out, "count gp by $comm run workload getppid 5 0 lose 7")
    note = "7 hits were lost (full record rings or missed probes): the counts above miss them"
    assert got[-3:] == ["@[workload]: 5", "@lost: 7", note]
    assert run(shell, out, "count gp run workload getppid 2")[-1] == "@: 2"  # nothing lost: no @lost line


def test_count_several_events_keys_by_event() -> None:
    shell, _t, out = make_shell()
    run(shell, out, "p:a vfs_read")
    run(shell, out, "p:b vfs_write")
    assert run(shell, out, "count run workload getppid 2")[-2:] == ["@[a]: 2", "@[b]: 2"]


def test_hist_by_argument() -> None:
    shell, _t, out = make_shell()
    run(shell, out, "p:rd vfs_read count=%dx:u64")
    got = run(shell, out, "hist rd by count run workload read 5 3000")
    assert got[2:] == ["@count: ", f"{'[2K, 4K)':<16}{5:>8} |{'@' * 52}|", ""]
    assert run(shell, out, "hist rd by size for 1") == [
        "error: kprobes/rd has no argument 'size' (count); `help count` lists the keys"
    ]
    assert run(shell, out, "hist rd by $comm")[0].startswith("error: hist needs a numeric value")


class _Frame:
    """What the shell uses of a drgn StackFrame."""

    def __init__(self, pc: int, symbol: tuple[str, int] | None, inline: bool = False) -> None:
        self.pc, self._symbol, self.is_inline = pc, symbol, inline

    def symbol(self) -> SimpleNamespace:
        if self._symbol is None:
            raise LookupError(f"could not find symbol containing {self.pc:#x}")
        return SimpleNamespace(name=self._symbol[0], address=self._symbol[1])


def test_stack_key_is_bpftrace_s_kstack_of_the_hit() -> None:
    frames = [_Frame(0xFFFF_FFFF_8130_0000, ("__x64_sys_getppid", 0xFFFF_FFFF_8130_0000)),
              _Frame(0xFFFF_FFFF_8100_105B, ("do_syscall_64", 0xFFFF_FFFF_8100_1000), inline=True),
              _Frame(0xFFFF_FFFF_8100_105B, ("do_syscall_64", 0xFFFF_FFFF_8100_1000)),
              _Frame(0xFFFF_FFFF_C000_1234, None)]  # fmt: skip

    class Regs:
        def stack_trace(self) -> list[_Frame]:
            return frames

    # Real frames only (an inlined call has no return address of its own), decimal offsets.
    assert stack_unwinder()(Regs()) == ("__x64_sys_getppid+0", "do_syscall_64+91", "0xffffffffc0001234")  # type: ignore[arg-type]


def test_stack_key_counts_stacks_unwound_in_the_handler() -> None:
    from qprobe.events import EventHit
    from qprobe.shell.collect import Aggregation, Tap

    _shell, t, _out = make_shell()
    te = t.add_event("p:gp __x64_sys_getppid")
    agg = Aggregation("count", ("$stack",))
    calls: list[str] = []
    te.probe.pre_handler = lambda kp, regs: calls.append("orig")  # type: ignore[union-attr]
    with Tap([te], agg.add, lambda regs: (f"frame{regs}",)):
        for n in (1, 2, 2):
            te.probe.pre_handler(te.probe, n)  # type: ignore[union-attr,misc]  # the handler, then the hit
            te.callback(EventHit("gp", 0, 1, "w", 0.0, 0, "", {}, ""))  # type: ignore[misc]
    assert agg.counts == {("frame1",): 1, ("frame2",): 2} and calls == ["orig"] * 3
    assert te.callback is None and te.probe.pre_handler(te.probe, 0) is None  # type: ignore[union-attr]
    assert calls == ["orig"] * 4  # the original handler is back


def test_show_prints_ftrace_lines_while_a_command_runs() -> None:
    shell, _t, out = make_shell()
    run(shell, out, "p:gp __x64_sys_getppid")
    got = run(shell, out, "show gp run workload getppid 2")
    assert got[0] == "        workload-42      [000] .....     1.500000: gp: (__x64_sys_getppid+0x0/0x40)"
    assert len(got) == 4 and got[-1] == "exit status 0"


def test_show_for_seconds_ends_by_itself() -> None:
    shell, _t, out = make_shell()
    run(shell, out, "p:gp __x64_sys_getppid")
    assert run(shell, out, "show for 0.2") == []


def test_stats() -> None:
    shell, t, out = make_shell()
    run(shell, out, "p:gp __x64_sys_getppid")
    t.run("workload getppid 5")
    got = run(shell, out, "stats")
    assert got[0].split() == ["EVENT", "HITS", "NMISSED", "LOST", "HITS/S"]
    assert got[1].split()[:4] == ["kprobes/gp", "5", "0", "0"]


def test_run_prints_output_and_status() -> None:
    shell, _t, out = make_shell()
    assert run(shell, out, "run frob") == ["sh: frob: not found", "exit status 127"]


def test_sym_addr_and_x() -> None:
    shell, _t, out = make_shell()
    assert run(shell, out, "sym vfs_read") == ["vfs_read  0xffffffff81001000  size 0x1b0 (432)  func  .text"]
    assert [line.split()[0] for line in run(shell, out, "sym vfs_read*")] == ["vfs_read", "vfs_readv"]
    assert run(shell, out, "addr 0xffffffff81001010") == ["0xffffffff81001010  vfs_read+0x10/0x1b0  func"]
    assert run(shell, out, "addr vfs_write+4") == ["0xffffffff81001404  vfs_write+0x4/0x1c0  func"]
    dump = run(shell, out, "x linux_banner 32")
    assert dump == [
        f"{BANNER:08x}: 4c69 6e75 7820 7665 7273 696f 6e20 362e  Linux version 6.",
        f"{BANNER:08x}"[:-2] + "10: 312e 302d 3536 2d63 6c6f 7564 2d61 6d64  1.0-56-cloud-amd",
    ]
    partial = run(shell, out, "x linux_banner+8 5")
    assert partial == [f"{BANNER + 8:08x}: {'7273 696f 6e':<39}  rsion"]


def test_regs() -> None:
    shell, _t, out = make_shell()
    got = run(shell, out, "regs 1")
    assert got[0] == f"{'rax':<15}{'0x1':<19}1"
    assert got[1] == f"{'rbx':<15}{'0xfffffffffffffffe':<19}-2"
    assert "<vfs_read+0x10>" in got[3] and got[4].endswith("[ PF ZF IF ]")
    assert got[-1] == "vCPU 1 is in user mode"


def test_py_binds_target_and_survives_exit() -> None:
    shell, t, out = make_shell()
    seen: dict[str, object] = {}

    def fake_interact(banner: str, local: dict[str, object], exitmsg: str) -> None:
        seen.update(local)
        raise SystemExit(0)

    shell.interact = fake_interact
    assert run(shell, out, "py") == [] and seen["target"] is t and not shell.done


def test_load_runs_a_file_with_target_bound(tmp_path) -> None:  # type: ignore[no-untyped-def]
    shell, t, out = make_shell()
    good = tmp_path / "handlers.py"
    good.write_text("te = target.add_event('p:fromfile vfs_read')\nseen = qprobe.__name__\n")
    assert run(shell, out, f"load {good}") == [f"loaded {good}: 0 new probe(s); `list` shows them"]
    assert "kprobes/fromfile" in t.events and shell.loaded[str(good)]["seen"] == "qprobe"
    bad = tmp_path / "bad.py"
    bad.write_text("x = 1\nraise RuntimeError('nope')\n")
    assert run(shell, out, f"load {bad}") == [f"error: load {bad}: line 2: RuntimeError: nope"]
    syntax = tmp_path / "syntax.py"
    syntax.write_text("def (:\n")
    assert run(shell, out, f"load {syntax}") == [f"error: load {syntax}: line 1: invalid syntax"]


def test_gdb_live_commands_need_the_transport() -> None:
    shell, t, out = make_shell()
    got = run(shell, out, "gdb info registers")
    assert len(got) == 1 and got[0].startswith("error: live-target gdb commands need the gdb transport")

    t.gdb_console = lambda cmd: f"ran {cmd}"
    assert run(shell, out, "gdb info registers") == ["ran info registers"]


def test_help_and_quit() -> None:
    shell, _t, out = make_shell()
    text = run(shell, out, "help")
    assert any(line.startswith("count [EVENT...] [by KEY[, KEY...]]") for line in text)
    assert run(shell, out, "help hist")[0] == "hist EVENT by VALUE [every S] [for S | run CMD | since boot]"
    assert run(shell, out, "help lhist")[0].startswith("lhist(VALUE, MIN, MAX, STEP) [EVENT...]")
    assert run(shell, out, "help p:foo")[0].startswith("p[:[GRP/]EVENT]")
    run(shell, out, "quit")
    assert shell.done


def test_plain_output_has_no_escape_codes_and_colour_has() -> None:
    shell, _t, out = make_shell()
    run(shell, out, "frobnicate")
    assert "\x1b[" not in out.getvalue()
    import io

    coloured = io.StringIO()
    Shell(FakeTarget(), out=coloured, color=True).execute("frobnicate")  # type: ignore[arg-type]
    assert "\x1b[" in coloured.getvalue()


@pytest.mark.parametrize("line", ["p", "r", "p:x", "-:x", "r10:grp/ev vfs_read", "-:grp/"])
def test_definitions_are_recognised(line: str) -> None:
    from qprobe.shell.parse import is_definition

    assert is_definition(line)


def test_counts_by_func_and_event_are_each_probes_own_count() -> None:
    """``count`` with no key, by $func or by $event alone: the probes' nhit, which the guest keeps for every
    hit, so hits whose records never reached the host (a full ring) are counted too; by $comm, $func the
    records' keys are joined."""
    shell, _t, out = make_shell()
    run(shell, out, "p:a vfs_read")
    run(shell, out, "p:b vfs_write")
    assert run(shell, out, "count a run workload read 5 0 lose 7")[-1] == "@: 12"
    assert run(shell, out, "count by $func run workload read 3")[-2:] == ["@[vfs_read]: 3", "@[vfs_write]: 3"]
    assert run(shell, out, "count a b by $event run workload read 2")[-2:] == ["@[a]: 2", "@[b]: 2"]
    assert run(shell, out, "count by $comm, $event run workload read 1")[-2:] == [
        "@[workload, a]: 1",
        "@[workload, b]: 1",
    ]


def test_filter_sets_shows_and_clears_an_events_filter() -> None:
    shell, t, out = make_shell()
    run(shell, out, "p:rd vfs_read count=%dx:u64")
    assert run(shell, out, 'filter rd count >= 4096 && comm == "cat"') == [
        'kprobes/rd: filter count >= 4096 && comm == "cat"'
    ]
    assert run(shell, out, "filter rd") == ['kprobes/rd: count >= 4096 && comm == "cat"']
    te = t.events["kprobes/rd"]
    assert te.filter is not None and te.filter({"count": "4096", "comm": '"cat"'})
    assert not te.filter({"count": "4096", "comm": '"dd"'})
    assert run(shell, out, "filter rd 0") == ["kprobes/rd: no filter"] and te.filter is None
    assert run(shell, out, "filter rd nosuch > 1") == ["nosuch > 1", "^ Field not found"] and te.filter is None
    assert run(shell, out, "filter") == ["error: usage: filter EVENT... [EXPR | 0]"]


def test_format_refuses_a_numbers_conversion_of_text() -> None:
    shell, _t, out = make_shell()
    run(shell, out, "p:rd vfs_read count=%dx:u64 name=+0(%si):string")
    assert run(shell, out, 'format rd "%d\\n", $comm') == [
        "error: printf: %d takes a number, and $comm is text (use %s)"
    ]
    assert run(shell, out, 'format rd "%x\\n", name') == [
        "error: printf: %x takes a number, and name is not an integer argument (use %s)"
    ]
    assert run(shell, out, 'format rd "%s %d %u %s\\n", $comm, count, $pid, name') == [
        'kprobes/rd: printf "%s %d %u %s\\n", $comm, count, $pid, name'
    ]


def test_since_boot_folds_and_shows_the_hits_already_made() -> None:
    shell, t, out = make_shell()
    run(shell, out, "p:gp __x64_sys_getppid count=%dx")
    t.run("workload getppid 3")  # before the count: as boot-time events' hits are before the prompt
    assert run(shell, out, "count gp by $comm since boot") == ["@[workload]: 3"]
    assert run(shell, out, "count gp by count since boot") == ["@[0]: 1", "@[1]: 1", "@[2]: 1"]
    assert run(shell, out, "sum(count) gp since boot") == ["@count: 3"]
    got = run(shell, out, "show gp since boot")
    assert got == ["        workload-42      [000] .....     1.500000: gp: (__x64_sys_getppid+0x0/0x40)"] * 3
    assert t.events["kprobes/gp"].callback is None  # nothing was tapped
    # What the events did not keep is said, not silently left out.
    gp = t.events["kprobes/gp"]
    gp.hits.popleft()  # as TraceEvent keeps its last ``keep`` hits
    gp.evicted += 1
    gp.nhit += 4  # hits counted in guest RAM, with no record
    got = run(shell, out, "count gp since boot")
    assert got[-1] == "@: 2", got
    assert any("older hits fell out" in line for line in got), got
    assert any("4 hits were counted in guest RAM without a record" in line for line in got), got


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("count gp since", "since boot is the only since"),
        ("count gp since then", "since boot is the only since"),
        ("count gp since boot for 1", "not with for, run or every"),
        ("count gp every 1 since boot", "not with for, run or every"),
        ("show gp since boot run true", "not with for, run or every"),
        ("count gp since boot gp", "unexpected 'gp'"),
        ("count gp by $stack since boot", "$stack is unwound"),
    ],
)
def test_since_boot_is_refused_where_it_cannot_work(line: str, words: str) -> None:
    shell, _t, out = make_shell()
    run(shell, out, "p:gp __x64_sys_getppid")
    got = run(shell, out, line)
    assert len(got) == 1 and got[0].startswith("error: ") and words in got[0], got
