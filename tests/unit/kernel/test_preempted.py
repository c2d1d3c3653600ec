"""The verdict on preempted contexts (qprobe.kernel.preempted): which stack words say a task may resume in a region."""

from __future__ import annotations

import struct

import pytest

from qprobe.kernel import preempted
from qprobe.kernel.preempted import first_inside, live_span, words_of

STACK = 0xFFFF_C900_0001_0000
SIZE = 0x4000
START, LEN = 0xFFFF_FFFF_8120_0004, 8  # an optimized region: the jump's first byte and the bytes it displaces


def region_hit(stack_words: list[int]) -> int | None:
    """What the optimizer asks: a word strictly inside (START, START + LEN)?"""
    return first_inside(sorted(stack_words), START + 1, START + LEN)


@pytest.mark.parametrize(
    ("words", "hit"),
    [
        ([START + 3], START + 3),  # a preempted context's saved ip in the displaced instructions
        ([START + LEN - 1], START + LEN - 1),
        ([START], None),  # the jump's own address: a context resumes at the jump itself, whole
        ([START + LEN], None),  # the first byte after the region (where the detour returns)
        ([0, START - 1, START + LEN + 1, 2**64 - 1], None),
        ([START + LEN + 8, START + 5, START + 2], START + 2),  # the smallest of several
    ],
    ids=["saved ip inside", "last byte", "at the start", "at the end", "around it", "several"],
)
def test_only_words_strictly_inside_the_region_hold_the_jump(words: list[int], hit: int | None) -> None:
    assert region_hit(words) == hit


def test_a_scratch_area_counts_from_its_first_byte() -> None:
    base, size = 0xFFFF_FFFF_C000_0000, 0x20_0000
    words = sorted([base - 1, base + size])
    assert first_inside(words, base, base + size) is None
    assert first_inside(sorted([*words, base]), base, base + size) == base


def test_the_live_part_of_a_sleeping_tasks_stack_starts_at_its_saved_sp() -> None:
    assert live_span(STACK, STACK + 0x3E08, SIZE) == (STACK + 0x3E08, STACK + SIZE)
    assert live_span(STACK, STACK + 0x3E0B, SIZE) == (STACK + 0x3E08, STACK + SIZE)  # aligned down to a word
    # A saved sp outside the stack (cannot be trusted): all of it.
    assert live_span(STACK, STACK + SIZE, SIZE) == (STACK, STACK + SIZE)
    assert live_span(STACK, 0, SIZE) == (STACK, STACK + SIZE)


def test_stack_bytes_become_little_endian_words() -> None:
    data = struct.pack("<3Q", START + 3, 0, 2**64 - 1) + b"\x01\x02"
    assert words_of(data) == [START + 3, 0, 2**64 - 1]


def test_an_area_is_given_up_once_nothing_holds_it_and_kept_past_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """wait_preempted_out, as remove_all and recovery use it: look (VM stopped), let the guest run, look again."""
    clock = [0.0]
    monkeypatch.setattr(preempted.time, "monotonic", lambda: clock[0])
    calls: list[str] = []

    def run() -> None:
        calls.append("run")
        clock[0] += 4.0

    answers = iter(["a preempted task's stack holds 0x1", "a preempted task's stack holds 0x2", None])

    def look() -> str | None:
        calls.append("look")
        return next(answers)

    assert preempted.wait_preempted_out(look, run) is None
    assert calls == ["look", "run", "look", "run", "look"]  # the guest runs only between looks that found something
    clock[0] = 0.0
    still = "a preempted task's stack holds 0x3"
    assert preempted.wait_preempted_out(lambda: still, run) == still
    assert clock[0] > preempted.PREEMPTED_WAIT
