"""Parsing shell lines: which command, and the ``count``/``hist``/``show`` clauses.

Pure functions over strings; errors are :class:`ShellUsageError`, whose text
is the one line the shell prints.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from qprobe.errors import QprobeError

SPECIAL_KEYS = ("$comm", "$pid", "$cpu", "$stack")
NUMERIC_SPECIAL_KEYS = ("$pid", "$cpu")
# The head of a kprobe_events line: p, r, p:EV, r5:GRP/EV, -:EV ...
_DEFINITION = re.compile(r"^(?:[pr]\d*(?::\S*)?|-\S*)$")
_WORD = re.compile(r"\s*\S+")


class ShellUsageError(QprobeError):
    """A shell command was used wrongly; the message is one line."""


def split_command(line: str) -> tuple[str, str]:
    """``(command word, rest of the line)``; comments (``# ...`` at the start) and blanks give ``("", "")``."""
    text = line.strip()
    if not text or text.startswith("#"):
        return "", ""
    head, _, rest = text.partition(" ")
    return head, rest.strip()


def is_definition(line: str) -> bool:
    """Does the line add or remove a kprobe event (kprobe_events syntax) rather than name a command?"""
    head, _ = split_command(line)
    return bool(head) and bool(_DEFINITION.match(head))


def parse_int(text: str, what: str = "number") -> int:
    """Decimal, ``0x`` hex, ``0o``/``0b``; raises ShellUsageError naming ``what``."""
    try:
        return int(text.replace("_", ""), 0)
    except ValueError:
        raise ShellUsageError(f"{what} must be a number, not {text!r}") from None


def parse_seconds(text: str) -> float:
    """``5``, ``0.5``, ``2s``, ``100ms``, ``1m`` -> seconds."""
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m)?", text.strip())
    if not m:
        raise ShellUsageError(f"a duration is SECONDS (5, 0.5, 100ms, 2m), not {text!r}")
    value = float(m.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}[m.group(2)]
    if not math.isfinite(value) or value <= 0:
        raise ShellUsageError(f"a duration must be positive, not {text!r}")
    return value


@dataclass
class Collect:
    """What ``count``/``hist``/``show`` collect and for how long.

    ``events`` are patterns (names or globs); ``key`` is None for a plain count;
    ``seconds`` None and ``command`` None mean until Ctrl-C.
    """

    events: list[str] = field(default_factory=list)
    key: str | None = None
    seconds: float | None = None
    command: str | None = None


def parse_collect(rest: str, *, verb: str, need_key: bool = False, allow_key: bool = True) -> Collect:
    """``[EVENT...] [by KEY] [for SECONDS] [run CMD...]`` (``run`` takes the rest of the line)."""
    spec = Collect()
    words = rest.split()
    i = 0
    while i < len(words):
        w = words[i]
        if w == "run":
            command = _rest_after(rest, i)
            if not command:
                raise ShellUsageError(f"{verb}: run needs a guest command")
            spec.command = command
            break
        if w in ("by", "for"):
            if i + 1 >= len(words):
                raise ShellUsageError(f"{verb}: {w} needs {'a KEY' if w == 'by' else 'SECONDS'}")
            if w == "by":
                if not allow_key:
                    raise ShellUsageError(f"{verb} takes no 'by KEY'")
                if spec.key is not None:
                    raise ShellUsageError(f"{verb}: one 'by KEY' only")
                spec.key = _check_key(words[i + 1], verb)
            else:
                spec.seconds = parse_seconds(words[i + 1])
            i += 2
            continue
        if spec.key is not None or spec.seconds is not None:
            raise ShellUsageError(f"{verb}: unexpected {w!r} (events come first: {verb} EVENT by KEY for SECONDS)")
        spec.events.append(w)
        i += 1
    if spec.seconds is not None and spec.command is not None:
        raise ShellUsageError(f"{verb}: give 'for SECONDS' or 'run CMD', not both")
    if need_key and spec.key is None:
        raise ShellUsageError(f"usage: {verb} EVENT by KEY [for SECONDS | run CMD]")
    return spec


def _rest_after(rest: str, index: int) -> str:
    """The text after the ``index``-th word (``run``), whitespace inside kept."""
    pos = 0
    for _ in range(index + 1):
        m = _WORD.match(rest, pos)
        assert m is not None
        pos = m.end()
    return rest[pos:].strip()


def _check_key(key: str, verb: str) -> str:
    if key.startswith("$"):
        if key not in SPECIAL_KEYS:
            raise ShellUsageError(f"{verb}: unknown key {key!r}: an argument name, {', '.join(SPECIAL_KEYS)}")
        return key
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise ShellUsageError(f"{verb}: bad key {key!r}: an argument name, {', '.join(SPECIAL_KEYS)}")
    return key


def key_name(key: str) -> str:
    """The map name bpftrace-style: ``$pid`` -> ``pid``."""
    return key.lstrip("$")
