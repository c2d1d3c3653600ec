"""What a group of the shell's commands sees of the shell it runs in (qprobe.shell.core.Shell).

The shell owns the state that outlives one command (the target, where output
goes, when events were armed, how ``show`` prints them...); each group of
commands is handed the shell as a :class:`ShellContext` and registers its
command words with :meth:`CommandGroup.handlers`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from qprobe.events.funcs import Probeability

    from .output import Output
    from .printf import HitFormat
    from .target import ShellTarget

Handler = Callable[[str], None]  # a command's handler, given the rest of its line


class ShellContext(Protocol):
    """The shell's state and output, as its commands use them."""

    target: ShellTarget
    out: Output
    armed: dict[str, float]  # event or probe -> when the shell first saw it armed
    formats: dict[str, HitFormat]  # event name -> how `show` prints its hits
    probeability: Probeability | None  # the function list, built on first use
    loaded: dict[str, dict[str, object]]  # load FILE -> its globals
    interact: Callable[..., None] | None  # code.interact, replaceable in tests

    def note(self, text: str) -> None: ...
    def error(self, text: str) -> None: ...


class CommandGroup(Protocol):
    """Commands of one concept: each word it handles, with its handler."""

    def handlers(self) -> dict[str, Handler]: ...


__all__ = ["CommandGroup", "Handler", "ShellContext"]
