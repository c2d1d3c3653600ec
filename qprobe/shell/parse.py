"""Parsing shell lines: which command, and the ``count``/``hist``/``show`` clauses.

Pure functions over strings; errors are :class:`ShellUsageError`, whose text
is the one line the shell prints.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from qprobe.errors import QprobeError

SPECIAL_KEYS = ("$comm", "$pid", "$cpu", "$func", "$event", "$stack")
NUMERIC_SPECIAL_KEYS = ("$pid", "$cpu")
# The head of a kprobe_events line: p, r, p:EV, r5:GRP/EV, -:EV ...
_DEFINITION = re.compile(r"^(?:[pr]\d*(?::\S*)?|-\S*)$")
_WORD = re.compile(r"\s*\S+")
_BPFTRACE_UPROBE = re.compile(r"(?:uprobe|uretprobe|u|ur):/")


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


def is_bpftrace_uprobe(line: str) -> bool:
    """Does the line add a uprobe event as bpftrace names it (``uprobe:PATH:FUNC``, ``uretprobe:...``)?"""
    head, _ = split_command(line)
    return bool(_BPFTRACE_UPROBE.match(head))


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
    """What ``count``/``hist``/``show``... collect and for how long.

    ``events`` are patterns (names or globs); ``keys`` the parts of the map key (none
    for one total); ``seconds`` None and ``command`` None mean until Ctrl-C; ``every``
    prints and clears the map every so many seconds; ``since_boot``: the hits already
    made (the events' kept hits), not those to come.
    """

    events: list[str] = field(default_factory=list)
    keys: tuple[str, ...] = ()
    seconds: float | None = None
    command: str | None = None
    every: float | None = None
    since_boot: bool = False

    @property
    def key(self) -> str | None:
        """The key when it has one part, else None."""
        return self.keys[0] if len(self.keys) == 1 else None


# bpftrace's map functions the shell has; those in VALUE_FUNCS take the value to aggregate.
VALUE_FUNCS = ("sum", "avg", "min", "max", "stats", "hist", "lhist")


@dataclass(frozen=True)
class Call:
    """``sum(count)``, ``lhist(count, 0, 4096, 512)``: a map function, its value and lhist's bounds."""

    func: str
    value: str
    bounds: tuple[int, int, int] | None = None  # lhist's min, max, step


def split_call(line: str) -> tuple[Call, str] | None:
    """``(Call, rest of the line)`` for a line starting ``FUNC(VALUE[, ...])``, else None."""
    m = re.match(r"\s*(\w+)\(([^)]*)\)(.*)$", line, re.S)
    if m is None or m.group(1) not in VALUE_FUNCS:
        return None
    func, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
    value = _check_key(args[0], func) if args[0] else ""
    if not value or value == "$stack" or value == "$comm":
        raise ShellUsageError(f"{func}() takes a numeric value: an argument name, $pid or $cpu")
    if func == "lhist":
        if len(args) != 4:
            raise ShellUsageError("usage: lhist(VALUE, MIN, MAX, STEP) [EVENT...] [by KEY, ...]")
        lo, hi, step = (parse_int(a, what) for a, what in zip(args[1:], ("MIN", "MAX", "STEP"), strict=True))
        if step <= 0 or hi <= lo:
            raise ShellUsageError("lhist: STEP must be positive and MAX above MIN")
        if (hi - lo) // step > LHIST_MAX_BUCKETS:
            raise ShellUsageError(f"lhist: at most {LHIST_MAX_BUCKETS} buckets ((MAX - MIN) / STEP)")
        return Call(func, value, (lo, hi, step)), m.group(3).strip()
    if len(args) != 1:
        raise ShellUsageError(f"{func}() takes one value")
    return Call(func, value), m.group(3).strip()


LHIST_MAX_BUCKETS = 1000  # bpftrace's limit on (max - min) / step


def parse_collect(rest: str, *, verb: str, need_key: bool = False, allow_key: bool = True) -> Collect:
    """``[EVENT...] [by KEY[, KEY...]] [every S] [for SECONDS | run CMD... | since boot]`` (``run`` takes the rest)."""
    spec = Collect()
    words = rest.split()
    i = 0
    while i < len(words):
        w = words[i]
        if w == "since":
            if words[i + 1 : i + 2] != ["boot"]:
                raise ShellUsageError(f"{verb}: since boot is the only since")
            spec.since_boot = True
            i += 2
            continue
        if w == "run":
            command = _rest_after(rest, i)
            if not command:
                raise ShellUsageError(f"{verb}: run needs a guest command")
            spec.command = command
            break
        if w in ("by", "for", "every"):
            if i + 1 >= len(words):
                raise ShellUsageError(f"{verb}: {w} needs {'a KEY' if w == 'by' else 'SECONDS'}")
            if w == "by":
                if not allow_key:
                    raise ShellUsageError(f"{verb} takes no 'by KEY'")
                if spec.keys:
                    raise ShellUsageError(f"{verb}: one 'by KEY' only")
                # by $comm, fd  /  by $comm,fd  /  by $comm ,fd: the key runs on while commas join its words
                text = words[i + 1]
                i += 2
                while i < len(words) and (text.endswith(",") or words[i].startswith(",")):
                    text += words[i]
                    i += 1
                spec.keys = tuple(_check_key(part.strip(), verb) for part in text.split(","))
                continue
            if w == "every":
                spec.every = parse_seconds(words[i + 1])
            else:
                spec.seconds = parse_seconds(words[i + 1])
            i += 2
            continue
        if spec.keys or spec.seconds is not None or spec.every is not None or spec.since_boot:
            raise ShellUsageError(f"{verb}: unexpected {w!r} (events come first: {verb} EVENT by KEY for SECONDS)")
        spec.events.append(w)
        i += 1
    if spec.seconds is not None and spec.command is not None:
        raise ShellUsageError(f"{verb}: give 'for SECONDS' or 'run CMD', not both")
    if spec.since_boot and (spec.seconds is not None or spec.command is not None or spec.every is not None):
        raise ShellUsageError(f"{verb}: since boot takes the hits already made: not with for, run or every")
    if need_key and not spec.keys:
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
    if not key:
        raise ShellUsageError(f"{verb}: an empty key part (by KEY, KEY...)")
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
