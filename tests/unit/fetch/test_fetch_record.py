"""The length of a hit's record in the kernel's ring buffer (fetch.record), which refuses one past its bound."""

from __future__ import annotations

from fetch_fakes import symbol_exists

from qprobe.fetch import FAULT, ProbeEvent, SymbolValue, UprobeEvent, parse_event, parse_uprobe_event
from qprobe.fetch.record import record_length


def kprobe(text: str) -> ProbeEvent:
    ev = parse_event(text, symbol_exists=symbol_exists)
    assert isinstance(ev, ProbeEvent)
    return ev


def uprobe(text: str) -> UprobeEvent:
    ev = parse_uprobe_event(text, file_check=lambda path: "regular")  # type: ignore[arg-type]
    assert isinstance(ev, UprobeEvent)
    return ev


def test_a_path_string_at_the_bound_the_guests_check() -> None:
    """Debian's 6.1 and 6.12 never kept this event's record for a 4052-byte path, and did keep it for 4051
    bytes when the ring buffer added no time stamp: 4072 bytes is their bound (head 16, data_loc 4, the
    path and its NUL)."""
    ev = kprobe("p:gopen do_sys_openat2 path=+0(%si):ustring")
    assert record_length(ev, ["/" + "a" * 4050]) == 4072
    assert record_length(ev, ["/" + "a" * 4051]) == 4073


def test_a_faulted_string_stores_no_bytes_and_an_empty_one_its_nul() -> None:
    ev = kprobe("p:s vfs_read name=+0(%si):string")
    assert record_length(ev, [FAULT]) == 16 + 4
    assert record_length(ev, [""]) == 16 + 4 + 1


def test_a_return_probe_has_two_addresses_in_its_head_and_comm_is_a_string() -> None:
    ev = kprobe("r:r vfs_read ret=$retval who=$comm sym=%di:symbol")
    assert record_length(ev, [3, "workload", SymbolValue(0x10, "x")]) == 24 + 8 + (4 + 9) + 8


def test_fixed_arrays_and_string_arrays_count_every_element() -> None:
    ev = kprobe("p:a vfs_read b=+0(%si):u8[4] s=+0(%di):string[2]")
    assert record_length(ev, [[1, 2, 3, 4], ["ab", FAULT]]) == 16 + 4 + 2 * 4 + 3


def test_non_ascii_bytes_count_as_stored() -> None:
    ev = kprobe("p:s vfs_read name=+0(%si):string")
    raw = bytes([0xFF, 0xC3, 0xA9]).decode("utf-8", "surrogateescape")  # one invalid byte, one é
    assert record_length(ev, [raw]) == 16 + 4 + 3 + 1


def test_uprobes_heads_hold_one_address_or_two() -> None:
    entry = uprobe("p:u /bin/sh:0x10 s=+0(%di):ustring n=%ax:u32")
    ret = uprobe("r:u /bin/sh:0x10 r=%ax")
    assert record_length(entry, ["hi", 7]) == 16 + 4 + 4 + 3
    assert record_length(ret, [0]) == 24 + 8
