"""Which kprobe_events definitions an optimized probe can record in the guest (registers only)."""

from __future__ import annotations

import pytest

from qprobe.arch.inguest import KeyPart, KeySpec
from qprobe.arch.x86_64.arch import X86_64
from qprobe.events import event_filter, guest_filter, guest_key, in_guest
from qprobe.fetch import ProbeEvent, parse_event
from qprobe.fetch.filter import And, GuestReg, Not, Or, Pred


@pytest.mark.parametrize(
    ("definition", "expected"),
    [
        ("p:a vfs_read", True),
        ("p:a vfs_read c=%dx:u64 n=$arg1 who=$comm", True),
        ('p:a vfs_read x=%ax:b3@4/32 sp=$stack imm=\\1234 s=\\"hi\\":string', True),
        ("p:a vfs_read w=$comm:string", True),
        ("p:a vfs_read a=$arg6", True),
        ("p:a vfs_read a=$arg7", False),  # on the stack: a memory read at the hit
        ("p:a vfs_read x=$stack1", False),
        ("p:a vfs_read c=+0(%si):u64", False),
        ("p:a vfs_read s=+0(%si):string", False),
        ("p:a vfs_read v=@jiffies", False),
        ("p:a vfs_read v=+0(@jiffies):u64", False),
        ("r:a vfs_read r=$retval", False),  # return probes go through the host's instances
    ],
)
def test_in_guest(definition: str, expected: bool) -> None:
    ev = parse_event(definition, symbol_exists=lambda name: True)
    assert isinstance(ev, ProbeEvent)
    assert in_guest(ev, X86_64.registers) is expected


def test_json_gives_strings_as_strings_and_integers_as_numbers() -> None:
    """ftrace prints ``comm="workload"``; JSON says ``"comm": "workload"``, not ``"\\"workload\\""``."""
    from qprobe.events import EventHit, KprobeEvent

    ev = parse_event("p:a vfs_read who=$comm fd=%di:s32 c=%dx:x64 s=+0(%si):string", symbol_exists=lambda n: True)
    assert isinstance(ev, ProbeEvent)
    te = KprobeEvent(None, ev, None)  # type: ignore[arg-type]
    args = {"who": '"work"load"', "fd": "-3", "c": "0x10", "s": "(fault)"}
    hit = EventHit("a", 0, 42, "work\"load", 1.0, 0x1000, "vfs_read+0x0", args, "", numbers=te.numbers,
                   strings=te.strings)  # fmt: skip
    assert hit.as_json()["args"] == {"who": 'work"load', "fd": -3, "c": 16, "s": "(fault)"}


@pytest.mark.parametrize(
    ("definition", "keys", "value", "hist", "expected"),
    [
        ("p:a ksys_read fd=%di:s32 count=%dx:u64", ("$comm",), None, False, KeySpec((KeyPart("comm"),))),
        ("p:a ksys_read fd=%di:s32 count=%dx:u64", ("$func", "$comm", "$pid", "$cpu"), "count", False,
         KeySpec((KeyPart("comm"), KeyPart("pid"), KeyPart("cpu")), KeyPart("reg", "dx", 64))),
        ("p:a ksys_read fd=%di:s32 count=%dx:u64", ("fd",), "count", True,
         KeySpec((KeyPart("reg", "di", 32, True), KeyPart("hist", "dx", 64)))),
        ("p:a ksys_read fd=%di:s32 count=%dx:u64", ("$stack",), None, False, None),  # unwound on the host
        ("p:a ksys_read fd=%di:s32 name=+0(%si):string", ("name",), None, False, None),  # read from memory
        ("p:a ksys_read fd=%di:s32 c=%dx:u64 w=$comm", ("w",), None, False, None),  # a string argument
        ("p:a ksys_read fd=%di:s32 c=%dx:symbol", ("fd",), "c", False, None),  # the value is not a number
        ("p:a ksys_read fd=%di:s32 c=+8(%dx):u64", ("fd",), None, False, None),  # the event reads memory
    ],
)  # fmt: skip
def test_what_a_detour_can_fold(definition: str, keys: tuple[str, ...], value: str | None, hist: bool,
                                expected: KeySpec | None) -> None:  # fmt: skip
    ev = parse_event(definition, symbol_exists=lambda name: True)
    assert isinstance(ev, ProbeEvent)
    assert guest_key(ev, keys, value, hist, X86_64.registers) == expected


FILTERED = "p:a ksys_read fd=%di:s32 count=%dx:u64 who=$comm"


def test_a_filter_on_registers_is_its_own_tree_bound() -> None:
    """The detour's filter is the parsed tree itself, each leaf given the register and type it reads."""
    ev = parse_event(FILTERED, symbol_exists=lambda name: True)
    assert isinstance(ev, ProbeEvent)
    flt = event_filter(ev, "fd == -1 || !(count > 4096 && count & 0x7)")
    fd, count = GuestReg("di", 32, True), GuestReg("dx", 64, False)
    assert flt.tree == Or((Pred("fd", "==", -1), Not(And((Pred("count", ">", 4096), Pred("count", "&", 7))))))
    assert guest_filter(ev, flt, X86_64.registers) == Or(
        (Pred("fd", "==", -1, fd), Not(And((Pred("count", ">", 4096, count), Pred("count", "&", 7, count)))))
    )


@pytest.mark.parametrize(
    ("definition", "text"),
    [
        (FILTERED, "fd == 1 && who == sh"),  # a string: compared on the host
        (FILTERED, "fd == 1 || pid == 1"),  # a common field: only the host knows it
        (FILTERED, "fd == 0x80000000"),  # outside s32: the kernel's compare, not a register's
        (FILTERED, "count == -1"),  # outside u64
        ("p:a ksys_read fd=%di:s16", "fd == 1"),  # neither 32 nor 64 bits
        ("p:a ksys_read fd=%di:s32 c=+8(%dx):u64", "fd == 1"),  # the event reads memory
        ("p:a ksys_read fd=$arg7:s32", "fd == 1"),  # on the stack
    ],
)
def test_a_filter_the_guest_cannot_test_stays_on_the_host(definition: str, text: str) -> None:
    ev = parse_event(definition, symbol_exists=lambda name: True)
    assert isinstance(ev, ProbeEvent)
    assert guest_filter(ev, event_filter(ev, text), X86_64.registers) is None
