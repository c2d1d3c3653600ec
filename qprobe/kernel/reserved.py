"""Kernel text the kernel itself rewrites at run time, which kprobes must not touch.

``check_kprobe_address_safe`` refuses a probe on a jump-label site
(``jump_label_text_reserved``), a static-call site (``static_call_text_reserved``)
or a ``BUG()``/``WARN()`` instruction (``find_bug``), and x86's
``copy_optimized_instructions`` refuses a jump whose displaced bytes cover
such a site.  How many bytes a site occupies is the architecture's
(``Arch.jump_label_size``, ``Arch.static_call_size``).  The sites are read from vmlinux's own tables (relative
entries, so KASLR does not change them), a loaded module's from its
``struct module``; a table a kernel lacks reserves nothing.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Callable, Sequence

from qprobe.arch import Arch
from qprobe.errors import QprobeError
from qprobe.kernel.symbols import Symbols

# struct jump_entry with CONFIG_HAVE_ARCH_JUMP_LABEL_RELATIVE (x86_64 since Linux 4.19): s32 code,
# s32 target, long key.
JUMP_ENTRY_SIZE = 16
# struct static_call_site: s32 addr, s32 key.
STATIC_CALL_SITE_SIZE = 8


def _relative_sites(symbols: Symbols, start: str, stop: str, entry: int) -> list[int]:
    """Running addresses a table of relative entries points at (``&entry->field + entry->field``)."""
    if start not in symbols or stop not in symbols:
        return []
    lo, hi = symbols.address(start), symbols.address(stop)
    try:
        raw = symbols.file_bytes(lo, hi - lo)
    except QprobeError:
        return []
    return sorted(lo + i + struct.unpack_from("<i", raw, i)[0] for i in range(0, len(raw) - len(raw) % entry, entry))


class ReservedText:
    """Jump-label sites, static-call sites and BUG instructions of one kernel.

    ``read(addr, n)`` reads running kernel text (a jump-label site's size is
    what is there now); ``bug_entry_size`` is ``sizeof(struct bug_entry)``,
    None when unknown (then BUG instructions are not looked up).
    """

    def __init__(self, symbols: Symbols, read: Callable[[int, int], bytes], bug_entry_size: int | None,
                 arch: Arch) -> None:  # fmt: skip
        self._read = read
        self._arch = arch
        self._symbols = symbols  # its loaded modules' sites are checked too
        self.jump_labels = _relative_sites(symbols, "__start___jump_table", "__stop___jump_table", JUMP_ENTRY_SIZE)
        self.static_calls = _relative_sites(
            symbols, "__start_static_call_sites", "__stop_static_call_sites", STATIC_CALL_SITE_SIZE
        )
        # struct bug_entry starts with s32 bug_addr_disp (CONFIG_GENERIC_BUG_RELATIVE_POINTERS on x86_64).
        self.bugs = (
            set(_relative_sites(symbols, "__start___bug_table", "__stop___bug_table", bug_entry_size))
            if bug_entry_size
            else set()
        )

    def _jump_size(self, site: int) -> int:
        try:
            code = self._read(site, self._arch.jump_label_probe)
        except QprobeError:
            return self._arch.jump_label_max
        return self._arch.jump_label_size(code)

    @staticmethod
    def _overlapping(sites: Sequence[int], start: int, end: int, longest: int) -> Sequence[int]:
        """Sites that may overlap [start, end]: those from ``start - longest + 1`` to ``end``."""
        lo = bisect.bisect_left(sites, start - longest + 1)
        hi = bisect.bisect_right(sites, end)
        return sites[lo:hi]

    def conflict(self, start: int, end: int) -> str | None:
        """What reserves a byte of [start, end] (inclusive, as the kernel's checks take it), or None.

        A BUG instruction only reserves its own address (``find_bug``), as a probe's.
        """
        mod = self._symbols.module_of(start)
        jump_labels, static_calls = (
            (mod.jump_labels, mod.static_calls) if mod is not None else (self.jump_labels, self.static_calls)
        )
        for site in self._overlapping(jump_labels, start, end, self._arch.jump_label_max):
            if site + self._jump_size(site) > start:
                return f"a jump label at {site:#x}"
        call = self._arch.static_call_size
        for site in self._overlapping(static_calls, start, end, call):
            if site + call > start:
                return f"a static call at {site:#x}"
        if start in (mod.bugs if mod is not None else self.bugs):
            return "a BUG()/WARN() instruction"
        return None
