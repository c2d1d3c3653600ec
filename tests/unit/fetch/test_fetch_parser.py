"""Parser behaviour the selftests do not cover: 6.1 quirks, deletes, numbers."""

from __future__ import annotations

import dataclasses

import pytest
from fetch_fakes import X86, symbol_exists

from qprobe.errors import FetchArgError
from qprobe.fetch import DeleteEvent, ProbeEvent, check_event, format_event, parse_event, parse_events
from qprobe.fetch import messages as M
from qprobe.fetch.dialect import BASE
from qprobe.fetch.kstrto import kstrtol, kstrtouint, kstrtoul, simple_strtoul, split_args


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("10", 10), ("0x10", 16), ("0X1f", 31), ("010", 8), ("0", 0), ("+5", 5), ("7\n", 7),
        ("", None), ("+", None), ("-1", None), ("0x", None), ("08", None), ("1_0", None),
        ("18446744073709551615", (1 << 64) - 1), ("18446744073709551616", None), (" 1", None),
    ],
)  # fmt: skip
def test_kstrtoul(text: str, value: int | None) -> None:
    assert kstrtoul(text, 0) == value


@pytest.mark.parametrize(
    ("text", "value"),
    [("-10", -10), ("+10", 10), ("-0x10", -16), ("-", None), ("--1", None), ("+-1", None),
     ("-9223372036854775808", -(1 << 63)), ("-9223372036854775809", None), ("9223372036854775808", None)],
)  # fmt: skip
def test_kstrtol(text: str, value: int | None) -> None:
    assert kstrtol(text, 0) == value


def test_kstrtouint_and_simple_strtoul() -> None:
    assert kstrtouint("4294967295") == 0xFFFF_FFFF
    assert kstrtouint("4294967296") is None
    assert simple_strtoul("12@3") == (12, 2)
    assert simple_strtoul("0x1f/8") == (31, 4)
    assert simple_strtoul("0x@") == (0, 1)
    assert simple_strtoul("a") == (0, 0)


def test_split_args_keeps_columns() -> None:
    assert split_args(" p\t vfs_read  %ax ") == [(1, "p"), (4, "vfs_read"), (14, "%ax")]


def error(text: str, **kw: object) -> tuple[str, int]:
    with pytest.raises(FetchArgError) as info:
        parse_event(text, **kw)  # type: ignore[arg-type]
    return info.value.reason, info.value.column


@pytest.mark.parametrize(
    ("text", "reason", "column"),
    [
        ("", M.EMPTY_COMMAND, 0),
        ("   # only a comment", M.EMPTY_COMMAND, 0),
        ("a:myprobeaccept inet_csk_accept", M.NOT_A_PROBE, 0),
        ("p:onlyname", M.NO_PROBE_POINT, 11),
        ("p /bin/sh:0x10", M.UPROBE_SYNTAX, 2),
        ("r0 vfs_read", M.BAD_MAXACT, 1),
        ("r 0xffffffff81000000 $retval", M.RETVAL_ON_PROBE, 21),  # 6.1: no RETURN flag on addresses
        ("p 0xffffffff81000000 $arg1", M.BAD_VAR, 21),
        ("p vfs_read+4 $arg1", M.BAD_VAR, 13),
        ("r vfs_read $arg1", M.BAD_VAR, 11),
        ("p vfs_read $arg0", M.BAD_ARG_NUM, 11),
        ("p vfs_read $arg", M.BAD_VAR, 11),
        ("p vfs_read $stack2049", M.BAD_STACK_NUM, 11),
        ("p vfs_read $stack0x1", M.BAD_VAR, 11),
        ("p vfs_read %AX", M.BAD_REG_NAME, 11),
        ("p vfs_read +u4(+0(%none))", M.BAD_REG_NAME, 17),  # 6.1's caret is one short after +u
        ("p vfs_read $comm:x64", M.BAD_TYPE, 17),  # the kernel logs nothing here
        ('p vfs_read \\"a:b"', M.BAD_TYPE, 15),  # ':' always starts the type
        ("p vfs_read @mod:var", M.BAD_TYPE, 16),
        ("p vfs_read +u0(%di):u8[2]", M.BAD_STRING, 20),  # no arrays over user memory
        ("p vfs_read %ax:u8[2]", M.BAD_STRING, 15),
        ("p vfs_read %ax:b4@4/16x", M.BAD_TYPE, 15),
        ("p vfs_read %ax:b4@13/16", M.BAD_BITFIELD, 15),
        ("p vfs_read %ax:b4@4", M.BAD_TYPE, 15),
        ("p vfs_read common_pid=%ax", M.USED_ARG_NAME, 11),
        ("p vfs_read arg2=%ax %bx", M.USED_ARG_NAME, 20),
        ("p vfs_read @_sdata+abc", M.FAIL_REG_PROBE, 2),
        ("p vfs_read @", M.BAD_PROBE_ADDR, 2),
        ("p %return", M.BAD_PROBE_ADDR, 2),
        ("p vfs_read+0x100000000", M.BAD_PROBE_ADDR, 2),
        ("p:" + "e" * 65 + " vfs_read", M.EVENT_TOO_LONG, 2),
        ("p:.e vfs_read", M.NO_GROUP_NAME, 2),
        ("p:g-1/e vfs_read", None, 0),
        ("-", M.BAD_DELETE, 0),
        ("-:", M.BAD_DELETE, 0),
        ("- :e", M.BAD_DELETE, 0),
        (" -:e", M.NOT_A_PROBE, 1),
    ],
)
def test_quirks(text: str, reason: str | None, column: int) -> None:
    if reason is None:
        parse_event(text, dialect=X86)
        return
    assert error(text, symbol_exists=symbol_exists, dialect=X86) == (reason, column)


def test_unknown_symbols_need_a_symbol_table() -> None:
    assert isinstance(parse_event("p non_exist_func $arg1"), ProbeEvent)
    # Without the symbol, kprobe_on_func_entry() fails, so $arg1 is BAD_VAR first.
    assert error("p non_exist_func $arg1", symbol_exists=symbol_exists) == (M.BAD_VAR, 17)
    assert error("p non_exist_func %ax", symbol_exists=symbol_exists) == (M.BAD_PROBE_ADDR, 2)
    assert error("p vfs_read @nothing", symbol_exists=symbol_exists) == (M.BAD_PROBE_ADDR, 2)


def test_on_func_entry_for_endbr_functions() -> None:
    def entry(sym: str, off: int) -> bool:
        return off in (0, 4)

    ev = parse_event("r vfs_read+4 $retval", on_func_entry=entry)
    assert isinstance(ev, ProbeEvent) and format_event(ev) == "r:kprobes/r_vfs_read_4 vfs_read+4 arg1=$retval"
    assert isinstance(parse_event("p vfs_read+4 $arg1", on_func_entry=entry), ProbeEvent)
    assert error("r vfs_read+8", on_func_entry=entry) == (M.BAD_RETPROBE, 2)


def _endbr_entry(sym: str, off: int) -> bool:
    return off in (0, 4)


@pytest.mark.parametrize(
    "text",
    ["p:rd vfs_read fd=%di count=%dx:u64", "r vfs_read $retval", "p vfs_read+8 %ax", "p 0xffffffff81000000 %ax"],
)
def test_check_event_takes_a_parse_the_kernel_s_answers_agree_with_as_it_is(text: str) -> None:
    """A definition parsed before the symbols were known is not parsed again when they agree with that parse."""
    ev = parse_event(text)
    assert isinstance(ev, ProbeEvent)
    assert check_event(ev, symbol_exists=symbol_exists, on_func_entry=_endbr_entry) is ev


def test_check_event_parses_again_where_the_answers_change_the_parse() -> None:
    """+4 of an ENDBR function is its entry (so $arg1 is the first argument), another language is another parse."""
    ev = parse_event("p vfs_read+4 %ax")
    assert isinstance(ev, ProbeEvent) and not ev.fentry
    again = check_event(ev, symbol_exists=symbol_exists, on_func_entry=_endbr_entry)
    assert again is not ev and again.fentry and format_event(again) == format_event(ev)
    other = dataclasses.replace(BASE, thread_size=8192)
    assert check_event(ev, dialect=other) is not ev


@pytest.mark.parametrize(
    ("text", "kw"),
    [
        ("p non_exist_func $arg1", {"symbol_exists": symbol_exists}),
        ("p non_exist_func %ax", {"symbol_exists": symbol_exists}),
        ("p vfs_read @nothing", {"symbol_exists": symbol_exists}),
        (
            "p vfs_read %ax",
            {
                "symbol_count": lambda name: 2,
                "dialect": dataclasses.replace(BASE, messages=frozenset([M.NON_UNIQ_SYMBOL])),
            },
        ),
    ],
)
def test_check_event_refuses_what_parse_event_refuses_with_the_same_answers(text: str, kw: dict[str, object]) -> None:
    ev = parse_event(text, dialect=kw.get("dialect", BASE))  # type: ignore[arg-type]
    assert isinstance(ev, ProbeEvent)
    with pytest.raises(FetchArgError) as info:
        check_event(ev, **kw)  # type: ignore[arg-type]
    assert (info.value.reason, info.value.column) == error(text, **kw)


def test_long_auto_event_name_is_cut_and_sanitized() -> None:
    sym = "a.b:" + "x" * 80
    ev = parse_event(f"p {sym}")
    assert isinstance(ev, ProbeEvent)
    assert ev.event == ("p_" + sym)[:63].replace(".", "_").replace(":", "_")


@pytest.mark.parametrize(
    ("text", "group", "event", "args"),
    [
        ("-:myprobe", None, "myprobe", []),
        ("-:grp/", "grp", "", []),
        ("-:grp/ev vfs_read arg1=%ax", "grp", "ev", ["vfs_read", "arg1=%ax"]),
        ("-:a/b/c", "a", "b/c", []),
    ],
)
def test_delete(text: str, group: str | None, event: str, args: list[str]) -> None:
    ev = parse_event(text)
    assert isinstance(ev, DeleteEvent)
    assert (ev.group, ev.event, ev.args) == (group, event, args)


def test_delete_matching() -> None:
    probe = parse_event("p:grp/ev vfs_read+8 x=%ax y=%bx")
    assert isinstance(probe, ProbeEvent)
    for text, hit in [
        ("-:ev", True),
        ("-:grp/", True),
        ("-:other/", False),
        ("-:grp/ev vfs_read+8", True),
        ("-:grp/ev vfs_read+8 x=%ax", True),
        ("-:grp/ev vfs_read+8 x=%bx", False),
        ("-:grp/ev vfs_read", False),
        ("-:grp/ev vfs_read+8 x=%ax y=%bx z=%cx", False),
    ]:
        delete = parse_event(text)
        assert isinstance(delete, DeleteEvent)
        assert delete.matches(probe) is hit, text


def test_parse_events_skips_blank_and_comment_lines() -> None:
    events = parse_events("# header\n\np:a vfs_read\n  \n-:a # bye\nr vfs_read $retval\n")
    assert [type(e).__name__ for e in events] == ["ProbeEvent", "DeleteEvent", "ProbeEvent"]
    with pytest.raises(FetchArgError):
        parse_event("p vfs_read\np do_exit")


@pytest.mark.parametrize("text", ["vfs_read count", "vfs_read:0 file", "do_sys_open%return", "ev=vfs_read +0(%di)"])
def test_perf_probe_syntax_without_its_word_says_how_to_write_it(text: str) -> None:
    with pytest.raises(FetchArgError) as info:
        parse_event(text)
    assert info.value.reason == f"{M.NOT_A_PROBE}; in perf probe's language write: perf {text}"
    assert not info.value.logged


@pytest.mark.parametrize("text", ["q vfs_read", "1abc", "%di"])
def test_a_typo_is_not_taken_for_perf_syntax(text: str) -> None:
    with pytest.raises(FetchArgError) as info:
        parse_event(text)
    assert info.value.reason == M.NOT_A_PROBE


def test_register_names_are_the_dialect_s() -> None:
    """%REG takes the architecture's pt_regs names: arm64's x0 on a kernel of its, not x86's di, and the other
    way on x86's; the language without a kernel knows no architecture, so any name but none."""
    arm64 = dataclasses.replace(BASE, registers=frozenset({*(f"x{n}" for n in range(31)), "sp", "pc", "pstate"}))
    assert parse_event("p vfs_read %x0", symbol_exists=symbol_exists, dialect=arm64)
    assert parse_event("p vfs_read %di", symbol_exists=symbol_exists, dialect=X86)
    for dialect, refused in ((arm64, "%di"), (X86, "%x0"), (BASE, "%")):
        assert error(f"p vfs_read {refused}", symbol_exists=symbol_exists, dialect=dialect) == (M.BAD_REG_NAME, 11)
    assert parse_event("p vfs_read %di %x0", symbol_exists=symbol_exists)
