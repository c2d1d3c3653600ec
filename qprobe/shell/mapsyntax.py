"""bpftrace's spellings of a map, as the shell's and ``trace --map``'s own: ``@NAME[KEY, ...] = FUNC(ARGS)``
and ``count()``.

``@[$comm] = count() rd run CMD`` is ``count rd by $comm run CMD`` with the map named ``@``;
``@bytes[$pid] = sum(count)`` is ``sum(count) by $pid`` named ``@bytes``.  Pure functions over
strings; a bad spelling is a :class:`ShellUsageError` naming what is wrong.
"""

from __future__ import annotations

import re

from .parse import VALUE_FUNCS, ShellUsageError

MAP_FUNCS = ("count", *VALUE_FUNCS)
CLAUSES = ("by", "every", "for", "run", "since")  # what follows a map's events
MAP_USAGE = "@NAME[KEY, ...] = FUNC(ARGS)"
_ASSIGN = re.compile(r"@(\w*)\s*(?:\[([^\]]*)\])?\s*=\s*(.*)$", re.S)
_CALL = re.compile(r"(\w+)\(([^)]*)\)(.*)$", re.S)


def map_line(line: str) -> tuple[str | None, str] | None:
    """``(name, line)`` for a map in bpftrace's spelling: its name (None when it is not an ``@`` assignment)
    and the line in the shell's own words; None for any other line."""
    text = line.strip()
    if text.startswith("@"):
        return _assignment(text)
    m = _CALL.match(text)
    if m is not None and m.group(1) == "count":
        return None, _count_call(m.group(2), m.group(3))
    return None


def _assignment(text: str) -> tuple[str, str]:
    if "[" in text.split("=", 1)[0] and "]" not in text.split("=", 1)[0]:
        raise ShellUsageError(f"{text!r}: '[' without ']' (expected {MAP_USAGE})")
    m = _ASSIGN.match(text)
    if m is None:
        raise ShellUsageError(f"{text!r}: expected {MAP_USAGE}")
    name, keys, rhs = m.group(1), m.group(2), m.group(3).strip()
    call = _CALL.match(rhs)
    if call is None:
        raise ShellUsageError(f"@{name} = needs a map function ({', '.join(f + '()' for f in MAP_FUNCS)}), "
                              f"not {rhs!r}")  # fmt: skip
    func, args, rest = call.groups()
    if func not in MAP_FUNCS:
        raise ShellUsageError(f"unknown map function {func}(): one of {', '.join(f + '()' for f in MAP_FUNCS)}")
    head = _count_call(args, "") if func == "count" else f"{func}({args})"
    if keys is None:
        return name, head + rest
    if not keys.strip():
        raise ShellUsageError(f"@{name}[]: an empty key (give KEY, ... inside the brackets, or no brackets)")
    return name, head + _with_keys(rest, keys)


def _count_call(args: str, rest: str) -> str:
    if args.strip():
        raise ShellUsageError(f"count() takes no argument, not {args.strip()!r} (count by KEY counts by a key)")
    return f"count{rest}"


def _with_keys(rest: str, keys: str) -> str:
    """``rest`` (what follows a map's function: events, clauses) with ``by KEYS`` after its events."""
    for m in re.finditer(r"\S+", rest):
        if m.group() == "by":
            raise ShellUsageError("a map's keys go in its brackets or after 'by', not both")
        if m.group() in CLAUSES:
            return f"{rest[: m.start()]}by {keys} {rest[m.start() :]}"
    return f"{rest.rstrip()} by {keys}"


__all__ = ["MAP_FUNCS", "MAP_USAGE", "map_line"]
