"""A definition parsed once into its typed head: the probe point's kind, the spans carets need."""

from __future__ import annotations

import pytest

from qprobe.errors import FetchArgError
from qprobe.fetch import Address, FilePoint, Glob, Symbol, parse_definition


@pytest.mark.parametrize(
    ("text", "point"),
    [
        ("p:rd vfs_read fd=%di", Symbol("vfs_read", 0)),
        ("p vfs_read+0x10", Symbol("vfs_read", 16)),
        ("r vfs_read%return", Symbol("vfs_read", 0)),
        ("p vfs_read+zz", Symbol("vfs_read", None)),  # the kernel's parser says what is wrong with it
        ("p btrfs:btrfs_sync_file", Symbol("btrfs:btrfs_sync_file", 0)),
        ("p 0xffffffff81000100", Address(0xFFFF_FFFF_8100_0100)),
        ("p:vfs vfs_*%return", Glob("vfs_*")),
        ("p:uq /bin/uprog:qpt_target+4(0x20)", FilePoint("/bin/uprog", "qpt_target+4(0x20)")),
        ("p /a:b/prog:0x10", FilePoint("/a:b/prog", "0x10")),  # a path may hold ':' too: the last one counts
        ("p:only", None),
    ],
)
def test_the_probe_point_is_typed(text: str, point: object) -> None:
    assert parse_definition(text).point == point


def test_the_words_keep_their_columns_and_the_comment_is_dropped() -> None:
    d = parse_definition("  r16:grp/ev   vfs_read+4  a=%di  b=$retval # why\n")
    assert d.head == "r16:grp/ev" and d.kind == "r" and d.name == "grp/ev"
    assert (d.point_column, d.point_word, d.place_name) == (15, "vfs_read+4", "vfs_read")
    assert d.args == ((27, "a=%di"), (34, "b=$retval"))
    assert not d.is_uprobe and not d.is_wildcard


def test_more_than_one_line_is_refused_as_the_parsers_refuse_it() -> None:
    with pytest.raises(FetchArgError, match="One definition per line") as e:
        parse_definition("p vfs_read\np vfs_write")
    assert e.value.column == 10


def test_a_replaced_word_moves_the_columns_after_it() -> None:
    d = parse_definition("p:u /bin/uprog:qpt_target%return  x=%di #c")
    out = d.replaced(1, 11, 21, "0x1a50")
    assert out.text == "p:u /bin/uprog:0x1a50%return  x=%di #c"
    assert out == parse_definition(out.text)
    glob = parse_definition("p:vfs   vfs_*+4 fd=%di")
    one = glob.with_point("p:vfs/vfs_read", "vfs_read", 5)
    assert one == parse_definition("p:vfs/vfs_read vfs_read+4 fd=%di")
