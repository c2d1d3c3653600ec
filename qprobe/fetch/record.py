"""How long the record of one hit is in the kernel's ring buffer, which refuses records past a bound.

A kprobe or uprobe event's handler (``__kprobe_trace_func``, ``__kretprobe_trace_func``,
``__uprobe_trace_func``) first measures its strings (``__get_data_size``), then asks
``trace_event_buffer_reserve`` for the entry head, the fixed part of the arguments and
the strings' bytes together.  ``ring_buffer_lock_reserve`` returns NULL for a length
past its bound (``BUF_MAX_DATA_SIZE``; the buffer's ``max_data_size`` since the
sub-buffer size became a knob in Linux 6.8), and the handler returns without a
record: the hit counts in kprobe_profile but leaves no trace line and no count of
its own.  A probe with long strings (a path near PATH_MAX, kernel memory read as a
string) is where that happens.
"""

from __future__ import annotations

from collections.abc import Sequence

from .args import Value
from .event import ProbeEvent
from .uevent import UprobeEvent

TRACE_ENTRY = 8  # struct trace_entry: type, flags, preempt_count, pid
ADDRESS = 8  # an unsigned long of the entry head: ip (vaddr[0]), and for a return probe func (vaddr[1])


def _stored(value: Value) -> int:
    """The bytes a value takes after the fixed part: a string's bytes and NUL; a faulted string none."""
    if isinstance(value, list):
        return sum(_stored(v) for v in value)
    if isinstance(value, str):  # not a SymbolValue: that is an int, stored in the fixed part
        return len(value.encode("utf-8", "surrogateescape")) + 1
    return 0


def record_length(ev: ProbeEvent | UprobeEvent, values: Sequence[Value]) -> int:
    """The length the event's handler reserves for this hit: head, fixed arguments, strings.

    The head is ``kprobe_trace_entry_head`` (ip), ``kretprobe_trace_entry_head`` (func, ret_ip)
    or ``uprobe_trace_entry_head`` with one or two addresses; a string's fixed part is its
    32-bit ``__data_loc``.  A faulted string stores no bytes (``__get_data_size`` adds only
    lengths above zero).
    """
    head = TRACE_ENTRY + ADDRESS * (2 if ev.is_return else 1)
    fixed = sum(a.type.size * (a.type.array or 1) for a in ev.args)
    return head + fixed + sum(_stored(v) for v, a in zip(values, ev.args, strict=True) if a.type.string)
