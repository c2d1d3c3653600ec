"""The bound the guest's ring buffer puts on one event's length, read from the running kernel.

``ring_buffer_lock_reserve`` refuses a length past it, and a kprobe or uprobe event's
handler then records nothing (qprobe.fetch.record).  Up to Linux 6.7 the bound is
``BUF_MAX_DATA_SIZE``: a page less the sub-buffer's header (``struct buffer_data_page``
up to its ``data``) and two u32s; Linux 6.8 ("ring-buffer: Add interface for configuring
trace sub buffer size") keeps it per buffer, in ``trace_buffer.max_data_size``, from the
size ``buffer_subbuf_size_kb`` sets.  The events qprobe emulates are the top instance's,
``global_trace``'s.  Measured on Debian's 6.1 and 6.12 (4 KiB pages, the default
sub-buffer): a record of 4073 bytes is never kept.  One of 4065 to 4072 bytes is kept
unless the ring buffer adds a time stamp to it (an 8-byte extend after a long gap since
the CPU's last event), which then overflows the sub-buffer: the host cannot see that,
and keeps those.
"""

from __future__ import annotations

import drgn

LENGTH_WORDS = 2 * 4  # BUF_MAX_DATA_SIZE = BUF_PAGE_SIZE - sizeof(u32) * 2


def max_event_length(prog: drgn.Program) -> int:
    """The longest event the top instance's ring buffer takes; raises LookupError without the kernel's types."""
    try:
        buffer = prog["global_trace"].array_buffer.buffer
        return int(buffer.max_data_size)
    except AttributeError:  # before Linux 6.8: one page less the header, for every buffer
        page = prog.type("struct buffer_data_page")
        data: int = drgn.offsetof(page, "data")
        return int(prog["PAGE_SIZE"]) - data - LENGTH_WORDS
