"""Parsing shell lines: commands, definitions, and the count/hist/show clauses."""

from __future__ import annotations

import pytest

from qprobe.shell.gdbcmd import gdb_argv, is_static
from qprobe.shell.parse import (
    Collect,
    ShellUsageError,
    is_definition,
    parse_collect,
    parse_int,
    parse_seconds,
    split_command,
)


def test_split_command() -> None:
    assert split_command("  x   linux_banner 32 ") == ("x", "linux_banner 32")
    assert split_command("# comment") == ("", "")
    assert split_command("") == ("", "")


@pytest.mark.parametrize("line", ["p:myread vfs_read count=%dx:u64", "r:ret ksys_read ret=$retval:s64", "p vfs_read",
                                  "r100 vfs_read", "-:myread", "-:kprobes/", "p:grp/ev vfs_read"])  # fmt: skip
def test_definitions(line: str) -> None:
    assert is_definition(line)


@pytest.mark.parametrize("line", ["py", "run ls", "regs", "pp", "list", "", "r-x", "print"])
def test_not_definitions(line: str) -> None:
    assert not is_definition(line)


def test_collect_clauses() -> None:
    assert parse_collect("gp by $comm", verb="count") == Collect(["gp"], ("$comm",))
    assert parse_collect("", verb="count") == Collect()
    assert parse_collect("a b for 2.5", verb="show", allow_key=False) == Collect(["a", "b"], (), 2.5)
    assert parse_collect("rd by count run workload read  5 3000", verb="hist") == Collect(
        ["rd"], ("count",), None, "workload read  5 3000"
    )
    # `run` takes the rest of the line, including words that are keywords elsewhere.
    assert parse_collect("gp run echo by for run", verb="count").command == "echo by for run"
    assert parse_collect("gp for 100ms", verb="count").seconds == pytest.approx(0.1)


@pytest.mark.parametrize(("rest", "kw", "message"), [
    ("gp by", {}, "count: by needs a KEY"),
    ("gp for", {}, "count: for needs SECONDS"),
    ("gp run", {}, "count: run needs a guest command"),
    ("gp by $nope", {}, "count: unknown key '$nope': an argument name, $comm, $pid, $cpu, $func, $event, $stack"),
    ("gp by 9lives", {}, "count: bad key '9lives': an argument name, $comm, $pid, $cpu, $func, $event, $stack"),
    ("gp by a by b", {}, "count: one 'by KEY' only"),
    ("gp by a extra", {}, "count: unexpected 'extra' (events come first: count EVENT by KEY for SECONDS)"),
    ("gp for 1 run ls", {}, "count: give 'for SECONDS' or 'run CMD', not both"),
    ("gp", {"need_key": True}, "usage: count EVENT by KEY [for SECONDS | run CMD]"),
    ("gp by $pid", {"allow_key": False}, "count takes no 'by KEY'"),
])  # fmt: skip
def test_collect_errors(rest: str, kw: dict[str, bool], message: str) -> None:
    with pytest.raises(ShellUsageError) as e:
        parse_collect(rest, verb="count", **kw)
    assert str(e.value) == message


def test_numbers_and_durations() -> None:
    assert parse_int("0x20") == 32 and parse_int("64") == 64 and parse_int("1_000") == 1000
    with pytest.raises(ShellUsageError, match="LEN must be a number, not 'lots'"):
        parse_int("lots", "LEN")
    assert parse_seconds("2m") == 120 and parse_seconds(".5") == 0.5
    for bad in ("0", "-1", "1h", "x"):
        with pytest.raises(ShellUsageError):
            parse_seconds(bad)


def test_gdb_static_commands() -> None:
    for cmd in (
        "ptype struct task_struct",
        "whatis jiffies",
        "info line vfs_read",
        "list vfs_read",
        "disassemble vfs_read",
        "p sizeof(struct file)",
        "p/x &init_task",
        "info symbol 0xffffffff81000000",
    ):
        assert is_static(cmd), cmd
    for cmd in ("info registers", "x/8x $sp", "bt", "p jiffies", "continue", "info threads", "stepi", ""):
        assert not is_static(cmd), cmd


def test_gdb_argv_loads_vmlinux_at_the_slide(tmp_path) -> None:  # type: ignore[no-untyped-def]
    argv = gdb_argv(tmp_path / "vmlinux", 0x2A00000, "disassemble vfs_read", tmp_path, [(".text", 0xFFFFFFFF81000000)])
    assert argv[:3] == ["gdb", "-batch", "-nx"]
    assert f"symbol-file -o 0x2a00000 {tmp_path / 'vmlinux'}" in argv and argv[-1] == "disassemble vfs_read"
    # The file's contents move with the symbols, so disassembly reads the right bytes.
    assert "section .text 0xffffffff83a00000" in argv
