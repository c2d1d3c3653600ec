"""Where the shell writes: rich colour on a terminal, plain text to a file or pipe."""

from __future__ import annotations

import sys
from typing import TextIO

from rich.console import Console
from rich.text import Text

from qprobe.fetch import terminal_safe

STYLES = {
    "error": "bold red",
    "caret": "bold red",
    "note": "dim",
    "ok": "green",
    "event": "cyan",
    "key": "cyan",
    "addr": "yellow",
    "header": "bold",
    "bar": "green",
}


class Output:
    """Text out, styled only when the file is a terminal (and NO_COLOR is not set)."""

    def __init__(self, file: TextIO | None = None, color: bool | None = None) -> None:
        self.file = file
        self.console = Console(
            file=file, highlight=False, markup=False, emoji=False, soft_wrap=True,
            force_terminal=True if color else None, no_color=color is False or None,
            color_system="auto" if color is not False else None,
        )  # fmt: skip

    @property
    def color(self) -> bool:
        return self.console.color_system is not None and self.console.is_terminal

    @property
    def terminal(self) -> bool:
        return self.console.is_terminal

    def _safe(self, text: str) -> str:
        """On a terminal, guest text's control characters shown as ``\\xNN`` (they would act on it)."""
        return terminal_safe(text) if self.console.is_terminal else text

    def write(self, text: str, style: str | None = None, *, escaped: bool = False) -> None:
        """``text`` as is (it carries its own newlines), in a named style.

        On a terminal its control characters are shown as ``\\xNN``, unless it is ``escaped`` already
        (a printf line: the user's own escapes act, the guest's text in it was escaped before).
        """
        if not text:
            return
        text = text if escaped else self._safe(text)
        self.console.print(Text(text, style=STYLES.get(style or "", style or "")), end="")

    def line(self, text: str = "", style: str | None = None) -> None:
        self.write(text + "\n", style)

    def parts(self, *pieces: tuple[str, str | None]) -> None:
        """One line of differently styled pieces."""
        text = Text()
        for piece, style in pieces:
            text.append(self._safe(piece), style=STYLES.get(style or "", style or ""))
        text.append("\n")
        self.console.print(text, end="")

    def flush(self) -> None:
        (self.file or sys.stdout).flush()
