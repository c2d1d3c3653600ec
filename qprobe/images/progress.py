"""Progress output for the slow steps: downloads and extracting vmlinux.

A first run moves ~300 MB (the cloud kernel's debug package) or ~900 MB (the
RT one), so a user must see it advance. On a terminal that is a rich
progress bar on stderr; otherwise (CI logs, pipes) one plain line per step,
so logs stay readable. ``enabled=False`` prints nothing at all.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

__all__ = ["Reporter", "wanted"]


def human(n: int) -> str:
    """Bytes as a short human-readable size."""
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"


def wanted() -> bool:
    """Progress bars unless logging was turned down to errors only (``qprobe --quiet``)."""
    return logging.getLogger().getEffectiveLevel() <= logging.WARNING


class Reporter:
    """Tells the user what a fetch or build is doing."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._console = Console(stderr=True) if enabled else None
        self.fancy = bool(self._console is not None and self._console.is_terminal)

    def note(self, message: str) -> None:
        """One line about a step that is quick or has no measurable size."""
        if not self.enabled:
            return
        if self.fancy and self._console is not None:
            self._console.print(f"[dim]qprobe:[/dim] {message}", highlight=False)
        else:
            print(f"qprobe: {message}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def transfer(self, description: str, total: int | None) -> Iterator[Callable[[int, int | None], None]]:
        """Track a byte count; yields ``update(completed, total)``.

        ``total`` may be unknown at first (None) and given later through
        ``update``, as when the size of a tar member is only known once its
        header has been read.
        """
        if not self.fancy or self._console is None:
            size = f" ({human(total)})" if total else ""
            self.note(f"{description}{size}...")

            def quiet(completed: int, new_total: int | None = None) -> None:
                del completed, new_total

            yield quiet
            return
        columns = (
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=self._console, transient=False) as bar:
            task = bar.add_task(description, total=total)

            def update(completed: int, new_total: int | None = None) -> None:
                if new_total is not None:
                    bar.update(task, completed=completed, total=new_total)
                else:
                    bar.update(task, completed=completed)

            yield update
            bar.update(task, completed=bar.tasks[0].total or bar.tasks[0].completed)
