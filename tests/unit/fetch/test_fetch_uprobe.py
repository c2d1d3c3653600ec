"""The uprobe_events language: trace_uprobe.c's parser, its errors and carets, user-space evaluation and output."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from fetch_fakes import FakeContext, u64
from test_fetch_dialect_612 import D612

from qprobe.errors import FetchArgError
from qprobe.fetch import (
    FAULT,
    DeleteEvent,
    Deref,
    FileOffset,
    UprobeEvent,
    UserFetchContext,
    check_uprobe_append,
    format_uprobe_event,
    format_uprobe_hit,
    format_uprobe_profile,
    parse_uprobe_event,
    print_fmt,
)
from qprobe.fetch import messages as M
from qprobe.fetch.dialect import BASE, Dialect

FILES = {"/bin/sh": "regular", "/bin/workload": "regular", "/sys": "other", "/lib/libc.so.6": "regular"}


def kind(path: str) -> str:
    return FILES.get(path, "missing")


def parse(text: str, dialect: Dialect = BASE) -> UprobeEvent:
    ev = parse_uprobe_event(text, dialect, file_check=kind)  # type: ignore[arg-type]
    assert isinstance(ev, UprobeEvent)
    return ev


def error(marked: str, dialect: Dialect = BASE) -> tuple[str, int, bool]:
    with pytest.raises(FetchArgError) as info:
        parse_uprobe_event(marked.replace("^", ""), dialect, file_check=kind)  # type: ignore[arg-type]
    return info.value.reason, info.value.column, info.value.logged


# tools/testing/selftests/ftrace/test.d/kprobe/uprobe_syntax_errors.tc, '^' where the kernel's caret is
SELFTEST = [
    ("p ^/non_exist_file:100", M.FILE_NOT_FOUND),
    ("p ^/sys:100", M.NO_REGULAR_FILE),
    ("p /bin/sh:^10a", M.BAD_UPROBE_OFFS),
    ("p /bin/sh:10(^1a)", M.BAD_REFCNT),
    ("p /bin/sh:10(10^", M.REFCNT_OPEN_BRACE),
    ("p /bin/sh:10(10)^a", M.BAD_REFCNT_SUFFIX),
    ("p /bin/sh:10 ^@+ab", M.BAD_FILE_OFFS),
    ("p /bin/sh:10 ^@symbol", M.SYM_ON_UPROBE),
]


@pytest.mark.parametrize("dialect", [BASE, D612], ids=["6.1", "6.12"])
@pytest.mark.parametrize(("marked", "message"), SELFTEST)
def test_selftest_errors(marked: str, message: str, dialect: Dialect) -> None:
    assert error(marked, dialect) == (message, marked.index("^"), True)


@pytest.mark.parametrize(
    ("marked", "message"),
    [
        ("p /bin/sh:10^%ret", M.BAD_ADDR_SUFFIX),
        ("p /bin/sh:10(0x10)^%return", M.BAD_REFCNT_SUFFIX),
        ("p /bin/sh:^0x", M.BAD_UPROBE_OFFS),
        ("p /bin/sh:^99999999999999999999", M.BAD_UPROBE_OFFS),
        ("p:^/ev /bin/sh:10", M.NO_GROUP_NAME),
        ("p:^ /bin/sh:10", M.NO_EVENT_NAME),
        ("p:g/^1ev /bin/sh:10", M.BAD_EVENT_NAME),
        ("p /bin/sh:10 ^$retval", M.RETVAL_ON_PROBE),
        ("p /bin/sh:10 ^$arg1", M.BAD_VAR),
        ("p /bin/sh:10 ^foo", M.BAD_FETCH_ARG),
        ("p /bin/sh:10 ^%ax:symbol", M.BAD_FETCH_ARG),
        ("p /bin/sh:10 %ax:^string", M.BAD_STRING),
        ("p /bin/sh:10 +0(^" + "+0(" * 14 + "%ax" + ")" * 15, M.TOO_MANY_OPS),
    ],
)
def test_errors_in_6_1(marked: str, message: str) -> None:
    if ":symbol" in marked:  # 6.1.0 has no uprobe type check: :symbol is accepted
        assert parse(marked.replace("^", "")).args[0].type.name == "symbol"
        return
    got = error(marked)
    assert got[:2] == (message, marked.index("^")), got


@pytest.mark.parametrize(
    ("marked", "message"),
    [
        ("p /bin/sh:10 ^$arg1", M.NOFENTRY_ARGS),
        ("p /bin/sh:10 ^$arg0", M.BAD_ARG_NUM),
        ("p /bin/sh:10 ^foo", M.NOSUP_BTFARG),
        ("p /bin/sh:10 %ax:^symbol", M.BAD_TYPE),
        ("p /bin/sh:10 %ax:^symstr", M.BAD_TYPE),
        ("p /bin/sh:10 $comm:^u32", M.NEED_STRING_TYPE),
    ],
)
def test_errors_in_6_12(marked: str, message: str) -> None:
    assert error(marked, D612)[:2] == (message, marked.index("^"))


@pytest.mark.parametrize(
    "text", ["x /bin/sh:10", "p /bin/sh", "p bin:10", "p", "p /bin/sh:abc", "p /bin/sh:-1", "-:", "-"]
)
def test_what_the_kernel_refuses_without_logging(text: str) -> None:
    with pytest.raises(FetchArgError) as info:
        parse_uprobe_event(text, file_check=kind)  # type: ignore[arg-type]
    assert not info.value.logged


@pytest.mark.parametrize(
    ("text", "listing"),
    [
        ("p /bin/workload:0x1136", "p:uprobes/p_workload_0x1136 /bin/workload:0x0000000000001136"),
        ("r /bin/workload:4406", "r:uprobes/p_workload_0x1136 /bin/workload:0x0000000000001136"),
        ("p /bin/sh:10%return(0x20)", "r:uprobes/p_sh_0xa /bin/sh:0x000000000000000a(0x20)"),
        ("p /bin/sh:10(0)", "p:uprobes/p_sh_0xa /bin/sh:0x000000000000000a"),
        ("p /lib/libc.so.6:0x10", "p:uprobes/p_libc_0x10 /lib/libc.so.6:0x0000000000000010"),
        ("p1 /bin/sh:10", "p:uprobes/p_sh_0xa /bin/sh:0x000000000000000a"),
        ("p:grp/ /bin/sh:10", "p:grp/p_sh_0xa /bin/sh:0x000000000000000a"),
        ("p:ev /bin/sh:10 %ax a=+0(%sp):u8[2]", "p:uprobes/ev /bin/sh:0x000000000000000a arg1=%ax a=+0(%sp):u8[2]"),
        ("p /bin/sh:10 @+0x10:u64 @+-16 @0x1000", "p:uprobes/p_sh_0xa /bin/sh:0x000000000000000a "
         "arg1=@+0x10:u64 arg2=@+-16 arg3=@0x1000"),
        ("r /bin/sh:10 $retval $stack $stack100000 $comm", "r:uprobes/p_sh_0xa /bin/sh:0x000000000000000a "
         "arg1=$retval arg2=$stack arg3=$stack100000 arg4=$comm"),
    ],
)  # fmt: skip
def test_listings(text: str, listing: str) -> None:
    assert format_uprobe_event(parse(text)) == listing
    assert format_uprobe_event(parse(text, D612)) == listing


def test_file_offsets_read_as_the_kernel_does() -> None:
    """@+OFFS: FETCH_OP_FOFFS then a dereference that keeps OFFS as its own offset."""
    ev = parse("p /bin/sh:10 @+0x10")
    assert ev.args[0].expr == Deref(FileOffset(0x10), 0x10)


@dataclass
class UserContext(FakeContext):
    """A uprobe hit: user memory only, the probed file mapped at ``base``."""

    base: int = 0x400000

    def file_address(self, offset: int) -> int:
        return self.base + offset


SP = 0x7FFD_0000_1000


def test_a_uprobe_reads_user_memory_only() -> None:
    ctx = UserContext(
        regs={"sp": SP, "di": 0x600000, "si": 0xFFFF_8880_0000_0000, "ax": 7},
        memory={0xFFFF_8880_0000_0000: b"kernel\0"},
        user_memory={SP: u64(0x600000) + u64(42), 0x600000: b"\0", 0x400020: u64(0x1234)},
        task_comm="workload",
    )
    assert isinstance(ctx, UserFetchContext)
    ev = parse("p /bin/sh:10 +0(%di):string +0(%si):string $stack1 $stack9 $stack @+0x10 +0(%si):u8 $comm "
               '\\"lit" \\0x600000:string')  # fmt: skip
    assert ev.evaluate(ctx) == ["", FAULT, 42, 0, SP, 0x1234, FAULT, "workload", FAULT, ""]


def test_output_lines() -> None:
    ev = parse("p:ev /bin/sh:10 a=%ax s=$comm")
    assert format_uprobe_hit(ev, [1, "sh"], 0x40100A) == '(0x40100a) a=0x1 s="sh"'
    ret = parse("r:ev /bin/sh:10 a=$retval:s32")
    assert format_uprobe_hit(ret, [-1], 0x401200, 0x40100A) == "(0x401200 <- 0x40100a) a=-1"
    assert format_uprobe_profile(ev, 12) == "  /bin/sh ev" + " " * 43 + " " * 13 + "12"
    assert print_fmt(ret) == '"(%lx <- %lx) a=%d", REC->__probe_func, REC->__probe_ret_ip, REC->a'


def test_appending_to_an_event() -> None:
    first = parse("p:e /bin/sh:10 a=%ax")
    check_uprobe_append(parse("p:e /bin/sh:20 a=%bx"), [first])
    for marked, message in [
        ("^r:e /bin/sh:20 a=%ax", M.DIFF_PROBE_TYPE),
        ("p:e /bin/sh:20 ^b=%ax", M.DIFF_ARG_TYPE),
        ("^p:e /bin/sh:10 a=%ax", M.SAME_PROBE),
    ]:
        with pytest.raises(FetchArgError) as info:
            check_uprobe_append(parse(marked.replace("^", "")), [first])
        assert (info.value.reason, info.value.column) == (message, marked.index("^"))


def test_deletion_matches_the_listed_place() -> None:
    ev = parse("p:e /bin/sh:10 a=%ax")
    delete = parse_uprobe_event("-:e /bin/sh:0x000000000000000a a=%ax")
    assert isinstance(delete, DeleteEvent) and delete.matches(ev)  # type: ignore[arg-type]
    other = parse_uprobe_event("-:e /bin/sh:0xa")
    assert isinstance(other, DeleteEvent) and not other.matches(ev)  # type: ignore[arg-type]


def test_symbol_types_are_refused_from_the_6_5_parser_on() -> None:
    """Debian's 6.1 has symstr's backport but not the uprobe type check; the 6.12 parser refuses both types."""
    old = Dialect(types=frozenset({"symstr"}), thread_size=16384)
    assert [a.type.name for a in parse("p /bin/sh:10 %ax:symstr %ax:symbol", old).args] == ["symstr", "symbol"]
    assert error("p /bin/sh:10 %ax:^symbol", D612)[:2] == (M.BAD_TYPE, len("p /bin/sh:10 %ax:"))
