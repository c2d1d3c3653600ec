"""perf probe's definition language, parsed: what a definition says, before anything is looked up.

``[perf] [[GROUP:]EVENT=]FUNC[@SRC][:RLN|+OFFS|%return|;PTN] [ARG...]`` or
``SRC:ALN|SRC;PTN``, each ARG ``[NAME=]VAR[->F|.F|[N]]...[:TYPE]`` or a raw
kprobe_events fetch argument, read as tools/perf/util/probe-event.c
(parse_perf_probe_point, parse_perf_probe_arg; Linux 6.1) reads them.  What
the words mean in vmlinux is resolved by :mod:`qprobe.kernel.perfprobe`; a
program's ``perf -x`` form (:mod:`qprobe.kernel.usyntax`) is parsed here too.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Any

from qprobe.errors import QprobeError

PERF_PREFIX = "perf"
_C_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class PerfProbeError(QprobeError):
    """A perf probe definition that cannot be parsed or resolved; the message is one line."""


@dataclass(frozen=True)
class PerfArg:
    """One ``[NAME=]VAR[->F|.F|[N]]...[:TYPE]`` argument, or a raw kprobe_events fetch argument."""

    text: str
    var: str
    fields: tuple[tuple[str, str], ...] = ()  # ("->" | "." | "[]", member name or index)
    name: str | None = None  # NAME= as given
    type: str | None = None

    @property
    def is_c_var(self) -> bool:
        return bool(_C_NAME.fullmatch(self.var))

    @property
    def event_name(self) -> str:
        """perf's name for it: NAME=, else the last member (not an index), else VAR with ``:`` as ``_``."""
        if self.name:
            return self.name
        members = [what for op, what in self.fields if op != "[]"]
        if members:
            return members[-1]
        return self.var + (f"_{self.type}" if self.type else "")


@dataclass(frozen=True)
class PerfProbe:
    text: str
    function: str | None = None
    file: str | None = None
    line: int | None = None  # relative to FUNC's declaration when function is set, else absolute
    offset: int = 0
    is_return: bool = False
    lazy: str | None = None
    event: str | None = None
    group: str | None = None
    args: tuple[PerfArg, ...] = ()


def is_perf_definition(text: str) -> bool:
    """A definition in perf probe's language says so: its first word is ``perf``."""
    return text.split(None, 1)[:1] == [PERF_PREFIX]


def parse_perf_probe(text: str) -> PerfProbe:
    """``[perf] [[GROUP:]EVENT=]FUNC[@SRC][:RLN|+OFFS|%return|;PTN] [ARG...]`` or ``SRC:ALN|SRC;PTN``."""
    body = text.strip()
    if is_perf_definition(body):
        body = body.split(None, 1)[1] if len(body.split(None, 1)) > 1 else ""
    try:
        words = shlex.split(body)
    except ValueError as exc:
        raise PerfProbeError(f"{text.strip()!r}: {exc}") from None
    if not words:
        raise PerfProbeError("perf: give a probe point, e.g. perf 'vfs_read count' or perf 'fs/read_write.c:473 ret'")
    probe = _parse_point(words[0])
    args = tuple(_parse_arg(w) for w in words[1:])
    if probe.is_return:
        for arg in args:
            if arg.is_c_var:
                raise PerfProbeError(f"{arg.text}: a return probe fetches $retval, not the function's variables")
    return PerfProbe(**{**probe.__dict__, "text": text.strip(), "args": args})


def _number(text: str, what: str, whole: str) -> int:
    if not re.fullmatch(r"\d+|0[xX][0-9a-fA-F]+", text):
        raise PerfProbeError(f"{whole}: {what} must be a number, not {text!r}")
    return int(text, 0)


def _parse_point(arg: str) -> PerfProbe:
    whole = arg
    event = group = None
    special = re.search(r"[;=@+%]", arg)
    if special and special.group() == "=":
        name, arg = arg[: special.start()], arg[special.end() :]
        group, _, event = name.rpartition(":")
        group = group or None
        for part in (group, event):
            if part is not None and not _C_NAME.fullmatch(part):
                raise PerfProbeError(f"{whole}: {part!r} is not a valid event name")
    # perf's rule (parse_perf_probe_point): a file if there is no + @ %, there is a : or ;, and a '.' before it.
    file_spec = False
    if not re.search(r"[+@%]", arg):
        sep = re.search(r"[;:]", arg)
        file_spec = bool(sep) and "." in arg[: sep.start() if sep else 0]
    m = re.match(r"[^;:+@%]*", arg)
    head, rest = m.group(), arg[m.end() :]  # type: ignore[union-attr]
    fields: dict[str, Any] = {"function": None, "file": None, "line": None, "offset": 0, "is_return": False,
                              "lazy": None, "event": event, "group": group}  # fmt: skip
    if not head:
        raise PerfProbeError(f"{whole}: no function or file name")
    fields["file" if file_spec else "function"] = head
    while rest:
        c, rest = rest[0], rest[1:]
        if c == ";":
            fields["lazy"], rest = rest, ""
            continue
        m = re.match(r"[^;:+@%]*", rest)
        value, rest = m.group(), rest[m.end() :]  # type: ignore[union-attr]
        if c == ":":
            if fields["line"] is not None or fields["offset"]:
                raise PerfProbeError(f"{whole}: a line number with an offset or a second line")
            fields["line"] = _number(value, "the line", whole)
        elif c == "+":
            if fields["line"] is not None or fields["file"]:
                raise PerfProbeError(f"{whole}: an offset is for FUNC+OFFS, without a line or a file")
            fields["offset"] = _number(value, "the offset", whole)
        elif c == "@":
            if fields["file"]:
                raise PerfProbeError(f"{whole}: a second file")
            fields["file"] = value
        elif c == "%":
            if value != "return":
                raise PerfProbeError(f"{whole}: unknown %{value}; perf has %return")
            fields["is_return"] = True
        if not value and c != "%":
            raise PerfProbeError(f"{whole}: nothing after {c!r}")
    if fields["is_return"] and (fields["line"] is not None or fields["lazy"] or fields["offset"]):
        raise PerfProbeError(f"{whole}: %return is for a function, not a line or an offset")
    if fields["file"] and not fields["function"] and fields["line"] is None and fields["lazy"] is None:
        raise PerfProbeError(f"{whole}: a file needs :LINE or ;PATTERN")
    return PerfProbe(text=whole, **fields)


def _parse_arg(text: str) -> PerfArg:
    name = None
    body = text
    m = re.match(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", body)
    if m:
        name, body = m.group(1), m.group(2)
    body, _, typ = body.partition(":")
    if not body:
        raise PerfProbeError(f"{text}: no variable")
    head = re.match(r"[A-Za-z_][A-Za-z0-9_]*", body)
    if not head or head.end() == len(body):
        return PerfArg(text=text, var=body, name=name, type=typ or None)
    fields = []
    rest = body[head.end() :]
    while rest:
        m = re.match(r"(->|\.)([A-Za-z_][A-Za-z0-9_]*)|\[(\d+|0[xX][0-9a-fA-F]+)\]", rest)
        if not m:
            raise PerfProbeError(f"{text}: cannot parse {rest!r} (fields are ->NAME, .NAME, [N])")
        fields.append((m.group(1), m.group(2)) if m.group(1) else ("[]", str(int(m.group(3), 0))))
        rest = rest[m.end() :]
    return PerfArg(text=text, var=head.group(), fields=tuple(fields), name=name, type=typ or None)
