"""ftrace_record_ips reads the guest's ``ftrace_pages`` list: what a page claims is bounded by its size and a budget."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import drgn
import pytest

from qprobe.kernel import tracefs

RECORD = 16  # struct dyn_ftrace: ip, flags (and arch data on some), as sizeof gives it
PAGE = 4096


@dataclass
class Value:
    value: int

    def value_(self) -> int:
        return self.value


@dataclass
class Page:
    records: Value
    index: Value
    order: Value
    next: Page | Value = field(default_factory=lambda: Value(0))

    def value_(self) -> int:
        return 1


class Member:
    offset = 0  # ip's, first in struct dyn_ftrace


class RecordType:
    def member(self, name: str) -> Member:
        assert name == "ip"
        return Member()


class Prog:
    """A guest whose records are all at address ``base``, each ip its index."""

    def __init__(self, first: Page, page_size: int | None = PAGE) -> None:
        self.first, self.page_size = first, page_size
        self.reads: list[int] = []

    def __getitem__(self, name: str) -> object:
        if name == "ftrace_pages_start":
            return self.first
        if name == "PAGE_SIZE" and self.page_size is not None:
            return Value(self.page_size)
        raise KeyError(name)

    def type(self, name: str) -> RecordType:
        return RecordType()

    def read(self, addr: int, size: int) -> bytes:
        self.reads.append(size)
        assert size <= 64 << 20, f"a read of {size} bytes"
        return b"".join(struct.pack("<QQ", 0xFFFF000000000000 + i, 0) for i in range(size // RECORD))


@pytest.fixture(autouse=True)
def record_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(drgn, "sizeof", lambda t: RECORD)


def test_every_record_of_every_page_is_read() -> None:
    second = Page(Value(0x2000), Value(3), Value(0))
    prog = Prog(Page(Value(0x1000), Value(5), Value(0), second))
    ips = tracefs.ftrace_record_ips(prog)  # type: ignore[arg-type]
    assert len(ips) == 5  # the second page's three are the first three again, as this fake lays them out
    assert prog.reads == [5 * RECORD, 3 * RECORD]


def test_a_page_claiming_more_records_than_it_holds_is_read_to_its_end_only() -> None:
    prog = Prog(Page(Value(0x1000), Value(1 << 31), Value(1)))
    tracefs.ftrace_record_ips(prog)  # type: ignore[arg-type]
    assert prog.reads == [(PAGE << 1)]


def test_without_a_page_size_the_budget_bounds_the_read() -> None:
    prog = Prog(Page(Value(0x1000), Value(1 << 40), Value(50)), page_size=None)
    tracefs.ftrace_record_ips(prog)  # type: ignore[arg-type]
    assert prog.reads == [tracefs.MAX_FTRACE_RECORDS * RECORD]


def test_a_negative_count_reads_nothing() -> None:
    prog = Prog(Page(Value(0x1000), Value(-7), Value(-1)))
    assert tracefs.ftrace_record_ips(prog) == frozenset()  # type: ignore[arg-type]
    assert prog.reads == [0]
