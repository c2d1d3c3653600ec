"""Entries in the guest kernel's own ``kprobe_blacklist`` over the text qprobe's jumps displace.

The guest's kprobes refuse an address holding an int3 that is not theirs
(``__copy_instruction`` in arch/x86/kernel/kprobes/core.c), so a probe of the
guest's on one of qprobe's int3s is refused cleanly.  A jump is another
matter: ``jmp rel32`` is an instruction the guest's kprobes accept and
emulate, so its int3 would go onto qprobe's jump, saving the jump's first
byte as the original.  qprobe's later restore of the displaced text would
overwrite that int3, and the guest's own restore would then put the jump's
opcode in front of the original bytes: a wild jump.  So while a jump is in
place its bytes are listed in ``kprobe_blacklist``, which
``check_kprobe_address_safe`` reads (``within_kprobe_blacklist``) for every
kprobe the guest registers: the guest gets EINVAL, as for any blacklisted
address, and its debugfs ``kprobes/blacklist`` names the range.

qprobe's entries make one run at the front of the list, where the guest
never adds (it appends at boot and at module load), linked and unlinked with
every vCPU stopped, so the guest sees the list whole.  The two words that
link the run in (the head's ``next`` and the old first entry's ``prev``) are
journaled with their original values, so a qprobe killed with jumps in place
leaves a list the next attach puts back.  Module text is not fenced: the
kernel frees a going module's blacklist entries with ``kfree``
(``kprobe_remove_area_blacklist``), and qprobe's live in its scratch area.
"""

from __future__ import annotations

import functools
import struct
from typing import TYPE_CHECKING

import drgn
from drgn.helpers.linux.list import hlist_for_each_entry

from qprobe.errors import QprobeError
from qprobe.vmm.journal import Patch

if TYPE_CHECKING:
    from qprobe.kernel.program import KernelData
    from qprobe.kernel.symbols import Symbols
    from qprobe.vmm.machine import Machine
    from qprobe.vmm.scratch import ScratchArea


class GuestBlacklist:
    """qprobe's entries in the guest's ``kprobe_blacklist`` (stop loop only)."""

    def __init__(self, machine: Machine, kernel: KernelData, symbols: Symbols, scratch: ScratchArea) -> None:
        self.machine = machine
        self.kernel = kernel
        self.symbols = symbols
        self.scratch = scratch
        self._first = 0  # the list's first entry before ours (while we have any)
        self.entries: set[int] = set()

    @functools.cached_property
    def layout(self) -> tuple[int, int, int, int] | None:
        """(list head, entry size, offset of start_addr, of end_addr), or None for a kernel without kprobes."""
        try:
            head = self.kernel.prog.object("kprobe_blacklist").address_
            entry = self.kernel.prog.type("struct kprobe_blacklist_entry")
            if head is None or entry.member("list").offset != 0:
                return None
            return head, entry.size, entry.member("start_addr").offset, entry.member("end_addr").offset
        except (QprobeError, LookupError):
            return None  # no CONFIG_KPROBES (or no debug info): no guest kprobe can land on our jumps

    def kprobes_in(self, start: int, end: int) -> list[int]:
        """Addresses in [start, end) where the guest kernel has kprobes of its own (its ``kprobe_table``).

        The table is the guest's answer where its text cannot tell: a kprobe it has already
        jump-optimized holds a ``jmp`` there, not an int3.
        """
        try:
            table = self.kernel.prog["kprobe_table"]
            found = []
            for i in range(table.type_.length or 0):
                for kp in hlist_for_each_entry("struct kprobe", table[i].address_of_(), "hlist"):
                    addr = kp.addr.value_()
                    if start <= addr < end:
                        found.append(addr)
            return sorted(found)
        except (QprobeError, LookupError, drgn.FaultError):
            return []  # no CONFIG_KPROBES: the guest has no kprobes

    def add(self, start: int, end: int) -> int | None:
        """List [start, end) in the guest's blacklist: the entry, or None (no list, or module text)."""
        layout = self.layout
        if layout is None or self.symbols.module_of(start) is not None:
            return None
        head, size, start_off, end_off = layout
        first = self.machine.mem.read_u64(head)  # head->next: ours, or the guest's first
        if first == head:
            return None  # an empty list: the guest's kprobes are not set up
        if not self.entries:
            self._first = first
        entry = self.scratch.alloc(size)
        body = bytearray(size)
        struct.pack_into("<QQ", body, 0, first, head)  # next, prev
        struct.pack_into("<Q", body, start_off, start)
        struct.pack_into("<Q", body, end_off, end)
        # Data, not code: written at once, never held back with a batch's code (ScratchArea.combined),
        # since the links read and written below and by the next add or remove must see it.
        self.machine.write_phys(self.scratch.phys_of(entry), bytes(body))
        # list_add at the head, every vCPU stopped: the entry is complete before anything points to it.
        self._set(first + 8, entry)
        self._set(head, entry)
        self.entries.add(entry)
        return entry

    def remove(self, entry: int) -> None:
        """list_del of our entry.

        Its memory is never reused: a context stopped while walking the list may still hold it
        (the scratch area outlives it until every probe is gone).
        """
        mem = self.machine.mem
        nxt, prev = mem.read_u64(entry), mem.read_u64(entry + 8)
        self.entries.discard(entry)
        self._set(prev, nxt)
        self._set(nxt + 8, prev)

    def _set(self, addr: int, value: int) -> None:
        """Write one link; the two that join our run to the guest's list are journaled with their originals."""
        layout = self.layout
        assert layout is not None
        head = layout[0]
        data = struct.pack("<Q", value)
        phys = self.machine.mem.virt_to_phys(addr)
        outside = {head: self._first, self._first + 8: head}
        if addr not in outside:
            self.machine.write_phys(phys, data)  # inside our run: scratch memory
            return
        original = struct.pack("<Q", outside[addr])
        if data == original:
            self.machine.write_phys(phys, data)
            self.machine.journal.forget(phys)
        else:
            self.machine.journal.record(Patch(phys, addr, original, data, "kprobe_blacklist link"))
            self.machine.write_phys(phys, data)


__all__ = ["GuestBlacklist"]
