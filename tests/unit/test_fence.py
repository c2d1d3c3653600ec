"""qprobe's entries in the guest's kprobe_blacklist: list_add and list_del, and what the journal keeps."""

from __future__ import annotations

import struct
from typing import Any

from qprobe.core.fence import GuestBlacklist
from qprobe.vmm.journal import Patch

HEAD, FIRST, LAST = 0x1000, 0x2000, 0x3000  # the guest's head and two entries of its own
SIZE, START, END = 32, 16, 24  # struct kprobe_blacklist_entry: list, start_addr, end_addr


class _Ram:
    """Guest memory as 8-byte words, virtual == physical."""

    def __init__(self) -> None:
        self.words: dict[int, int] = {}

    def read_u64(self, addr: int) -> int:
        return self.words[addr]

    def virt_to_phys(self, addr: int) -> int:
        return addr

    def write(self, addr: int, data: bytes) -> None:
        for i in range(0, len(data), 8):
            self.words[addr + i] = struct.unpack_from("<Q", data, i)[0]


class _Journal:
    def __init__(self) -> None:
        self.patches: dict[int, Patch] = {}

    def record(self, p: Patch) -> None:
        self.patches[p.phys] = p

    def forget(self, phys: int) -> None:
        self.patches.pop(phys, None)


class _Machine:
    def __init__(self) -> None:
        self.mem = _Ram()
        self.journal = _Journal()

    def write_phys(self, phys: int, data: bytes) -> None:
        self.mem.write(phys, data)


class _Scratch:
    def __init__(self, machine: _Machine) -> None:
        self.machine, self.next = machine, 0x9000

    def alloc(self, size: int) -> int:
        self.next += 64
        return self.next

    def phys_of(self, addr: int) -> int:
        return addr


class _Symbols:
    def module_of(self, addr: int) -> Any:
        return None


def _walk(ram: _Ram) -> list[int]:
    """The list from the head, checking every prev link on the way."""
    out, prev, node = [], HEAD, ram.read_u64(HEAD)
    while node != HEAD:
        assert ram.read_u64(node + 8) == prev
        out.append(node)
        prev, node = node, ram.read_u64(node)
    assert ram.read_u64(HEAD + 8) == prev
    return out


def _fence() -> tuple[GuestBlacklist, _Machine]:
    m = _Machine()
    for node, nxt, prev in ((HEAD, FIRST, LAST), (FIRST, LAST, HEAD), (LAST, HEAD, FIRST)):
        m.mem.words[node], m.mem.words[node + 8] = nxt, prev
    fence = GuestBlacklist(m, None, _Symbols(), _Scratch(m))  # type: ignore[arg-type]
    fence.__dict__["layout"] = (HEAD, SIZE, START, END)
    return fence, m


def _restore(m: _Machine) -> None:
    """What attach does with a dead qprobe's journal."""
    for p in m.journal.patches.values():
        assert m.mem.read_u64(p.phys) == struct.unpack("<Q", p.new)[0]
        m.mem.write(p.phys, p.old)


def test_entries_go_in_front_and_come_out_in_any_order() -> None:
    fence, m = _fence()
    a = fence.add(0x100, 0x105)
    b = fence.add(0x200, 0x206)
    assert a is not None and b is not None
    assert _walk(m.mem) == [b, a, FIRST, LAST]
    assert (m.mem.read_u64(a + START), m.mem.read_u64(a + END)) == (0x100, 0x105)
    fence.remove(a)
    assert _walk(m.mem) == [b, FIRST, LAST]
    fence.remove(b)
    assert _walk(m.mem) == [FIRST, LAST]
    assert m.journal.patches == {}  # the list is the guest's again: nothing to undo


def test_a_dead_qprobes_journal_unlinks_all_its_entries() -> None:
    fence, m = _fence()
    a = fence.add(0x100, 0x105)
    fence.add(0x200, 0x206)
    assert a is not None
    fence.remove(a)  # the oldest gone: the old first entry's prev link changed again
    fence.add(0x300, 0x303)
    _restore(m)
    assert _walk(m.mem) == [FIRST, LAST]


def test_the_guests_appends_at_the_tail_are_kept() -> None:
    fence, m = _fence()
    a = fence.add(0x100, 0x105)
    assert a is not None
    new = 0x4000  # the guest's list_add_tail at a module load
    m.mem.words[new], m.mem.words[new + 8] = HEAD, LAST
    m.mem.words[LAST], m.mem.words[HEAD + 8] = new, new
    fence.remove(a)
    assert _walk(m.mem) == [FIRST, LAST, new]


def test_a_kernel_without_kprobes_is_not_fenced() -> None:
    fence, _m = _fence()
    fence.__dict__["layout"] = None
    assert fence.add(0x100, 0x105) is None
