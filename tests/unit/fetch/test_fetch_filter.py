"""ftrace's event filter language (qprobe trace --filter): parsing, errors with their column, evaluation."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qprobe.errors import FetchArgError
from qprobe.fetch import ProbeEvent, parse_event
from qprobe.fetch.filter import And, EventFilter, GuestReg, Not, Pred, bind, evaluator

NUMERIC = {"count", "fd", "flags"}
STRINGS = {"path"}


def flt(text: str) -> EventFilter:
    return EventFilter(text, NUMERIC, STRINGS)


HIT = {"count": "4096", "fd": "0x3", "flags": "0x8241", "path": '"/etc/passwd"', "comm": "cat", "pid": 77,
       "common_pid": 77, "cpu": 1}  # fmt: skip


EVALUATES = [
    ("count == 4096", True),
    ("count != 4096", False),
    ("count > 4095 && count < 4097", True),
    ("count >= 4097 || fd == 3", True),
    ("count <= 4095", False),
    ("fd == 0x3", True),
    ("flags & 0x40", True),
    ("flags & 0x10", False),
    ("!(fd == 3)", False),
    ("!fd == 4", True),
    ('comm == "cat"', True),
    ("comm == cat", True),
    ("comm != 'cat'", False),
    ('comm ~ "c*"', True),
    ('comm ~ "?at"', True),
    ('comm ~ "[bc]at"', True),
    ('path ~ "*passwd"', True),
    ('path == "/etc/passwd"', True),
    ("common_pid == 77 && cpu == 1", True),
    ("pid == 78", False),
    ("(count == 1 || count == 4096) && (comm == cat)", True),
    ("count == 1 || count == 2 && fd == 3", False),  # && binds tighter than ||
    ("count == -1", False),
]


@pytest.mark.parametrize(("text", "expected"), EVALUATES)
def test_filter_evaluates(text: str, expected: bool) -> None:
    assert flt(text)(HIT) is expected


def test_a_fault_matches_no_numeric_test() -> None:
    assert not flt("count >= 0")({**HIT, "count": "(fault)"})
    assert flt("!(count >= 0)")({**HIT, "count": "(fault)"})


@pytest.mark.parametrize(
    ("text", "message", "column"),
    [
        ("", "Meaningless filter expression", 0),
        ("size == 3", "Field not found", 0),
        ("count = 3", "Invalid operator", 6),
        ("count | 3", "Invalid operator", 6),
        ("count ~ 3", "Illegal operation for field type", 6),
        ('comm > "a"', "Illegal operation for field type", 5),
        ("count == abc", "Illegal integer value", 9),
        ('count == "3"', "Illegal integer value", 9),
        ("count ==", "Missing field name and/or value", 8),
        ("count", "Invalid operator", 5),
        ("(count == 3", "Unbalanced parens", 0),
        ("count == 3)", "Too many ')'", 10),
        ('comm == "cat', "Missing matching quote", 8),
        ("count == 3 &&", "Missing field name and/or value", 13),
        ("== 3", "Missing field name and/or value", 0),
        ("count == 3 fd == 4", "Invalid operator", 11),
    ],
)
def test_filter_errors_name_the_problem_and_column(text: str, message: str, column: int) -> None:
    with pytest.raises(FetchArgError) as err:
        flt(text)
    assert err.value.reason == message
    assert err.value.column == column
    assert err.value.caret().splitlines()[1].index("^") == err.value.caret().splitlines()[0].index(text) + column


def test_fields_come_from_the_event_definition() -> None:
    from qprobe.events import event_filter

    ev = parse_event("p:myread vfs_read count=%dx:u64 name=+0(%si):string")
    assert isinstance(ev, ProbeEvent)
    f = event_filter(ev, 'count > 10 && name ~ "a*"')
    assert f({"count": "11", "name": '"abc"', "comm": "x", "pid": 1, "common_pid": 1, "cpu": 0})
    with pytest.raises(FetchArgError, match="Illegal operation"):
        event_filter(ev, "name > 3")
    with pytest.raises(FetchArgError, match="Field not found"):
        event_filter(ev, "arg1 > 3")


@given(st.text(alphabet="count=!<>&|~()\"' 0x123abc*", max_size=40))
def test_any_text_parses_or_fails_with_a_located_error(text: str) -> None:
    try:
        f = flt(text)
    except FetchArgError as exc:
        assert 0 <= exc.column <= len(text)
        return
    assert isinstance(f(HIT), bool)


@given(st.integers(-(2**63), 2**64 - 1), st.integers(-(2**63), 2**64 - 1))
def test_numeric_comparisons_agree_with_python(value: int, const: int) -> None:
    rec = {**HIT, "count": str(value)}
    assert flt(f"count < {const}")(rec) is (value < const)
    assert flt(f"count == {const:#x}" if const >= 0 else f"count == {const}")(rec) is (value == const)


@given(st.text(alphabet="count=!<>&|~()\"' 0x123abc*", max_size=40), st.integers(0, 1500), st.integers(0, 300))
def test_long_and_deep_text_parses_or_fails_with_a_located_error(text: str, nots: int, parens: int) -> None:
    # The short texts above never nest deeply; these add up to 1,500 '!' and 300 '(' around them.
    text = "!" * nots + "(" * parens + text + ")" * parens
    try:
        f = flt(text)
    except FetchArgError as exc:
        assert 0 <= exc.column <= len(text)
        return
    assert isinstance(f(HIT), bool)


@pytest.mark.parametrize(
    ("text", "column"),
    [("(" * 200 + "count == 1" + ")" * 200, 100), ("!" * 1000 + "count == 1", 100), ("(!" * 60 + "count == 1", 100)],
    ids=["200 parentheses", "1000 nots", "mixed"],
)
def test_nesting_too_deep_is_an_error_at_the_column(text: str, column: int) -> None:
    with pytest.raises(FetchArgError, match="Nested too deeply") as e:
        flt(text)
    assert e.value.column == column


def test_nesting_up_to_the_limit_evaluates() -> None:
    assert flt("(" * 100 + "count == 4096" + ")" * 100)(HIT) is True
    assert flt("!" * 100 + "count == 4096")(HIT) is True
    assert flt("!" * 99 + "count == 4096")(HIT) is False


AT = GuestReg("dx", 64, False)


def _count_in_a_register(p: Pred) -> GuestReg | None:
    """A made-up binding: the argument ``count`` is in a register; nothing else is."""
    return AT if p.field == "count" else None


@pytest.mark.parametrize(("text", "expected"), EVALUATES)
def test_a_bound_tree_evaluates_as_the_parsed_one(text: str, expected: bool) -> None:
    """The host evaluates the guest's (bound) tree as it does the parsed one: a leaf's register plays no part."""
    bound = bind(flt(text).tree, lambda p: AT)
    assert bound is not None
    assert evaluator(bound)(HIT) is expected


def test_a_tree_binds_only_when_every_leaf_does() -> None:
    tree = flt("count > 1 && !(count & 0x7)").tree
    assert bind(tree, _count_in_a_register) == And((Pred("count", ">", 1, AT), Not(Pred("count", "&", 7, AT))))
    assert bind(flt("count > 1 && fd == 3").tree, _count_in_a_register) is None
    assert bind(flt("count > 1 || !(comm == cat)").tree, _count_in_a_register) is None


def test_the_deepest_tree_binds() -> None:
    """bind recurses as the parser does, so any tree the parser accepts binds."""
    bound = bind(flt("!" * 100 + "count == 4096").tree, _count_in_a_register)
    assert bound is not None
    assert evaluator(bound)(HIT) is True
