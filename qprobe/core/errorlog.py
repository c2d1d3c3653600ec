"""Errors whose rate the guest decides, kept and printed within bounds.

A guest process can make the host fail as often as it likes: a root process writes forged requests to
the doorbell port, a handler raises on every hit of a hot probe, a callback on every event.  Each such
failure is counted, but only the first ``keep`` are kept, and warnings are rate-limited (``burst`` in any
``interval``, then one line saying how many were left out), so the host's memory and stderr stay bounded
however long the guest keeps at it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

__all__ = ["ErrorLog"]


class ErrorLog:
    """The first ``keep`` error lines, how many there were in all, and warnings at most ``burst`` an ``interval``."""

    def __init__(self, logger: logging.Logger, keep: int = 100, burst: int = 10, interval: float = 10.0) -> None:
        self.logger = logger
        self.keep = keep
        self.burst = burst
        self.interval = interval
        self.lines: list[str] = []
        self.count = 0
        self._lock = threading.Lock()
        self._window = -interval  # when the current window of warnings began
        self._shown = 0
        self._left_out = 0

    def add(self, line: str, detail: str = "") -> None:
        """Count ``line``, keep it if there is room, and warn (with ``detail`` after it) if the rate allows."""
        with self._lock:
            self.count += 1
            if len(self.lines) < self.keep:
                self.lines.append(line)
            now = time.monotonic()
            if now - self._window >= self.interval:
                if self._left_out:
                    self.logger.warning("%d more like the above in %g s were not shown", self._left_out, self.interval)
                self._window, self._shown, self._left_out = now, 0, 0
            if self._shown < self.burst:
                self._shown += 1
                self.logger.warning("%s%s", line, f"\n{detail}" if detail else "")
            else:
                self._left_out += 1

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.lines))

    def __len__(self) -> int:
        return len(self.lines)

    def __bool__(self) -> bool:
        return self.count > 0

    def __getitem__(self, index: slice) -> list[str]:
        return self.lines[index]
