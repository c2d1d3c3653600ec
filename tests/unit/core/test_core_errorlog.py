"""A guest that makes the host fail without end (forged mailbox requests, a handler raising on every hit)
grows neither the host's memory nor its stderr: lines kept and warnings printed are bounded."""

from __future__ import annotations

import logging

import pytest

from qprobe.core import errorlog
from qprobe.core.errorlog import ErrorLog


def test_a_hundred_thousand_failures_keep_a_hundred_lines_and_warn_ten_times(caplog: pytest.LogCaptureFixture) -> None:
    log = ErrorLog(logging.getLogger("qprobe.test"), keep=100, burst=10, interval=3600)
    with caplog.at_level(logging.WARNING, "qprobe.test"):
        for i in range(100_000):
            log.add(f"forged request {i}")
    assert log.count == 100_000 and len(log) == 100 and log.lines[-1] == "forged request 99"
    assert [r.getMessage() for r in caplog.records] == [f"forged request {i}" for i in range(10)]


def test_after_the_interval_it_says_how_many_were_left_out(caplog: pytest.LogCaptureFixture,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    now = [0.0]
    monkeypatch.setattr(errorlog.time, "monotonic", lambda: now[0])
    log = ErrorLog(logging.getLogger("qprobe.test"), keep=5, burst=2, interval=10)
    with caplog.at_level(logging.WARNING, "qprobe.test"):
        for i in range(5):
            log.add(f"e{i}", "detail")
        now[0] = 11.0
        log.add("e5")
    assert [r.getMessage() for r in caplog.records] == [
        "e0\ndetail",
        "e1\ndetail",
        "3 more like the above in 10 s were not shown",
        "e5",
    ]
    assert log.lines == ["e0", "e1", "e2", "e3", "e4"] and log.count == 6 and bool(log)
