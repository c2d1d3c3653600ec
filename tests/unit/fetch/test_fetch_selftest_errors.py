"""Every ``check_error`` of the 6.1 selftest kprobe_syntax_errors.tc, as data.

The lines below are copied verbatim from
tools/testing/selftests/ftrace/test.d/kprobe/kprobe_syntax_errors.tc (Linux
6.1): the ``^`` marks the error_log caret, so the text before it is the
column.  The selftest only checks the caret; the expected message comes
from the comment (the kernel's ERRORS name) and is checked too.
"""

from __future__ import annotations

import re

import pytest
from fetch_fakes import X86, symbol_exists

from qprobe.errors import FetchArgError
from qprobe.fetch import check_append, parse_event
from qprobe.fetch import messages as M

SELFTEST_LINES = r"""
check_error 'p^100 vfs_read'		# MAXACT_NO_KPROBE
check_error 'r^1a111 vfs_read'		# BAD_MAXACT
check_error 'r^100000 vfs_read'		# MAXACT_TOO_BIG
check_error 'p ^non_exist_func'		# BAD_PROBE_ADDR (enoent)
check_error 'p ^hoge-fuga'		# BAD_PROBE_ADDR (bad syntax)
check_error 'p ^hoge+1000-1000'		# BAD_PROBE_ADDR (bad syntax)
check_error 'r ^vfs_read+10'		# BAD_RETPROBE
check_error 'p:^/bar vfs_read'		# NO_GROUP_NAME
check_error 'p:^12345678901234567890123456789012345678901234567890123456789012345/bar vfs_read'	# GROUP_TOO_LONG
check_error 'p:^foo.1/bar vfs_read'	# BAD_GROUP_NAME
check_error 'p:^ vfs_read'		# NO_EVENT_NAME
check_error 'p:foo/^12345678901234567890123456789012345678901234567890123456789012345 vfs_read'	# EVENT_TOO_LONG
check_error 'p:foo/^bar.1 vfs_read'	# BAD_EVENT_NAME
check_error 'p vfs_read ^$retval'	# RETVAL_ON_PROBE
check_error 'p vfs_read ^$stack10000'	# BAD_STACK_NUM
check_error 'p vfs_read ^$arg10000'	# BAD_ARG_NUM
check_error 'p vfs_read ^$none_var'	# BAD_VAR
check_error 'p vfs_read ^%none_reg'	# BAD_REG_NAME
check_error 'p vfs_read ^@12345678abcde'	# BAD_MEM_ADDR
check_error 'p vfs_read ^@+10'		# FILE_ON_KPROBE
check_error 'p vfs_read arg1=\^x'	# BAD_IMM
check_error 'p vfs_read arg1=\"abcd^'	# IMMSTR_NO_CLOSE
check_error 'p vfs_read ^+0@0)'		# DEREF_NEED_BRACE
check_error 'p vfs_read ^+0ab1(@0)'	# BAD_DEREF_OFFS
check_error 'p vfs_read +0(+0(@0^)'	# DEREF_OPEN_BRACE
check_error 'p vfs_read +0(^$comm)'	# COMM_CANT_DEREF
check_error 'p vfs_read ^&1'		# BAD_FETCH_ARG
check_error 'p vfs_read +0(^+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(@0))))))))))))))'	# TOO_MANY_OPS?
check_error 'p vfs_read +0(@11):u8[10^'		# ARRAY_NO_CLOSE
check_error 'p vfs_read +0(@11):u8[10]^a'	# BAD_ARRAY_SUFFIX
check_error 'p vfs_read +0(@11):u8[^10a]'	# BAD_ARRAY_NUM
check_error 'p vfs_read +0(@11):u8[^256]'	# ARRAY_TOO_BIG
check_error 'p vfs_read @11:^unknown_type'	# BAD_TYPE
check_error 'p vfs_read $stack0:^string'	# BAD_STRING
check_error 'p vfs_read @11:^b10@a/16'		# BAD_BITFIELD
check_error 'p vfs_read ^arg123456789012345678901234567890=@11'	# ARG_NAME_TOO_LOG
check_error 'p vfs_read ^=@11'			# NO_ARG_NAME
check_error 'p vfs_read ^var.1=@11'		# BAD_ARG_NAME
check_error 'p vfs_read var1=@11 ^var1=@12'	# USED_ARG_NAME
check_error 'p vfs_read ^+1234567(+1234567(+1234567(+1234567(+1234567(+1234567(@1234))))))'	# ARG_TOO_LONG
check_error 'p vfs_read arg1=^'			# NO_ARG_BODY
check_error 'p ^vfs_read+3'		# BAD_INSN_BNDRY (only if function-tracer is enabled)
check_error '^r:kprobes/testevent do_exit'	# DIFF_PROBE_TYPE
check_error 'p vfs_read^%hoge'		# BAD_ADDR_SUFFIX
check_error 'p ^vfs_read+10%return'	# BAD_RETPROBE
"""

# The multiprobe part of the selftest uses double quotes and $FUNCTION_FORK
# (kernel_clone in 6.1); here it is expanded.  Each needs the event that the
# selftest writes first, so check_append() gets it as the existing probe.
MULTIPROBE_CASES = [
    ("p:kprobes/testevent kernel_clone", "^r:kprobes/testevent do_exit", "DIFF_PROBE_TYPE"),
    ("p:kprobes/testevent kernel_clone abcd=\\1", "p:kprobes/testevent kernel_clone ^bcd=\\1", "DIFF_ARG_TYPE"),
    ("p:kprobes/testevent kernel_clone abcd=\\1", "p:kprobes/testevent kernel_clone ^abcd=\\1:u8", "DIFF_ARG_TYPE"),
    ("p:kprobes/testevent kernel_clone abcd=\\1", 'p:kprobes/testevent kernel_clone ^abcd=\\"foo"', "DIFF_ARG_TYPE"),
    ("p:kprobes/testevent kernel_clone abcd=\\1", "^p:kprobes/testevent kernel_clone abcd=\\1", "SAME_PROBE"),
]

# Needs the instruction decoder (not this package): the kernel finds it when
# registering the probe, and so does qprobe (tests/vm/test_events.py checks it there).
NOT_A_PARSER_ERROR = {"BAD_INSN_BNDRY"}

_LINE = re.compile(r"check_error '(?P<cmd>.*)'\s*# (?P<err>[A-Z_]+)")
_TYPOS = {"ARG_NAME_TOO_LOG": "ARG_NAME_TOO_LONG"}


def _cases() -> list[tuple[str, int, str]]:
    out = []
    for line in SELFTEST_LINES.strip().splitlines():
        m = _LINE.search(line)
        assert m, line
        err = _TYPOS.get(m["err"], m["err"])
        out.append((m["cmd"], m["cmd"].index("^"), err))
    return out


CASES = _cases()
PARSER_CASES = [c for c in CASES if c[2] not in NOT_A_PARSER_ERROR]


def test_every_selftest_line_is_here() -> None:
    assert len(CASES) == 45
    assert len(PARSER_CASES) == 44


@pytest.mark.parametrize(("marked", "column", "err"), PARSER_CASES, ids=[c[2] + ":" + c[0] for c in PARSER_CASES])
def test_selftest_error(marked: str, column: int, err: str) -> None:
    command = marked.replace("^", "")
    if err == "DIFF_PROBE_TYPE":
        existing = parse_event("p:kprobes/testevent kernel_clone", symbol_exists=symbol_exists)
        new = parse_event(command, symbol_exists=symbol_exists)
        with pytest.raises(FetchArgError) as info:
            check_append(new, [existing])  # type: ignore[list-item]
    else:
        with pytest.raises(FetchArgError) as info:
            parse_event(command, symbol_exists=symbol_exists, dialect=X86)
    assert (info.value.reason, info.value.column) == (getattr(M, err), column)
    assert info.value.text == command


@pytest.mark.parametrize(("first", "marked", "err"), MULTIPROBE_CASES)
def test_selftest_multiprobe_error(first: str, marked: str, err: str) -> None:
    existing = parse_event(first, symbol_exists=symbol_exists)
    command = marked.replace("^", "")
    new = parse_event(command, symbol_exists=symbol_exists)
    with pytest.raises(FetchArgError) as info:
        check_append(new, [existing])  # type: ignore[list-item]
    assert (info.value.reason, info.value.column) == (getattr(M, err), marked.index("^"))
