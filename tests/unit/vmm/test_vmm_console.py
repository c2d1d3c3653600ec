"""The console kept in memory is bounded: the last MAX_TEXT characters and the oops lines, with offsets that
count everything printed, so a guest printing forever cannot grow qprobe without end."""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from qprobe.errors import GuestPanicked, TargetGone
from qprobe.vmm import console as console_mod
from qprobe.vmm.console import Console


@pytest.fixture
def guest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Console, socket.socket]]:
    """A Console on a socket whose other end (returned) the test writes as the guest would."""
    monkeypatch.setattr(console_mod, "MAX_TEXT", 1000)
    monkeypatch.setattr(console_mod, "MAX_OOPS", 5)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "console.sock"))
    listener.listen()
    accepted: list[socket.socket] = []
    thread = threading.Thread(target=lambda: accepted.append(listener.accept()[0]))
    thread.start()
    console = Console(tmp_path / "console.sock")
    thread.join()
    yield console, accepted[0]
    accepted[0].close()
    console.close()
    listener.close()


def test_a_console_that_prints_forever_is_kept_bounded(guest: tuple[Console, socket.socket]) -> None:
    console, far = guest
    lines = [f"line {i:06d} of noise\n" if i % 50 else f"BUG: number {i}\n" for i in range(1000)]
    far.sendall("".join(lines).encode())
    total = sum(map(len, lines))
    console.wait_for(r"line 000999 of noise\n", 5)
    assert console.end == total and len(console.text) <= 1000
    assert console.text.endswith("line 000999 of noise\n")
    # The oops lines survive the text they were in, up to MAX_OOPS of them.
    assert console.oopses() == [f"BUG: number {i}" for i in range(0, 250, 50)]
    # Offsets count what is no longer kept: a search from an old offset finds only what follows it.
    far.sendall(b"after the flood\n")
    assert console.wait_for(r"after the flood\n", 5, start=total) == total + len("after the flood\n")


def test_a_line_split_across_reads_is_one_oops_line(guest: tuple[Console, socket.socket]) -> None:
    console, far = guest
    far.sendall(b"[ 1.0] BU")
    console.wait_for(r"BU", 5)
    far.sendall(b"G: split in two\nnext\n")
    console.wait_for(r"next\n", 5)
    assert console.oopses() == ["[ 1.0] BUG: split in two"]
    assert re.search(r"BUG: split in two", console.text)


def test_a_console_that_closes_after_a_panic_says_so(guest: tuple[Console, socket.socket]) -> None:
    console, far = guest
    far.sendall(b"[ 1.5] Oops: int3: 0000 [#1] PREEMPT SMP NOPTI\n")
    far.sendall(b"[ 1.5] Kernel panic - not syncing: Fatal exception in interrupt\n[ 3.1] Shutting down cpus\n")
    far.close()
    with pytest.raises(GuestPanicked, match=r"waited for 'QPROBE-READY': Kernel panic - not syncing: Fatal exception"):
        console.wait_for("QPROBE-READY", 5)


def test_a_console_that_closes_without_a_panic_is_gone(guest: tuple[Console, socket.socket]) -> None:
    console, far = guest
    far.sendall(b"reboot: Power down\n")
    far.close()
    with pytest.raises(TargetGone) as info:
        console.wait_for("QPROBE-READY", 5)
    assert not isinstance(info.value, GuestPanicked)
