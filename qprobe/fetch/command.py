"""What a kprobe_events line and an uprobe_events line share, around each kind's own parser.

From kernel/trace/trace_probe.c (Linux 6.1): the line's argv with the columns
of the error log's caret (``trace_probe_log_err``), its event name
(``traceprobe_parse_event_name``), and the checks on a probe that joins an
existing event (``trace_probe_compare_arg_type`` and the same-probe check).
The kinds' parsers are :mod:`qprobe.fetch.event` and :mod:`qprobe.fetch.uevent`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Protocol, TypeVar

from qprobe.errors import FetchArgError

from . import messages as M
from .args import FetchArg
from .definition import Definition, parse_definition
from .dialect import BASE, Dialect
from .kstrto import is_good_name

_P = TypeVar("_P", bound="_Probe")


class Command:
    """The argv of one line, turning (word index, offset) into caret columns."""

    def __init__(self, definition: Definition, dialect: Dialect = BASE) -> None:
        self.definition = definition
        self.text = definition.text
        self.words = definition.words
        self.argv = [w for _, w in self.words]
        self.dialect = dialect

    def column(self, index: int, offset: int) -> int:
        if index >= len(self.words):  # the kernel points past the last word
            start, word = self.words[-1] if self.words else (0, "")
            return start + len(word) + 1
        return self.words[index][0] + offset

    def error(self, index: int, offset: int, message: str, logged: bool = True) -> FetchArgError:
        logged = logged and message not in M.UNLOGGED
        return FetchArgError(self.dialect.message(message), self.text, self.column(index, offset), logged=logged)


def parse_event_name(cmd: Command, name: str, offset: int) -> tuple[str | None, str | None]:
    """``traceprobe_parse_event_name``: (group or None, event or None for ``GRP/``)."""
    group = None
    slash = name.find("/")
    if slash < 0:
        slash = name.find(".")
    if slash >= 0:
        if slash == 0:
            raise cmd.error(0, offset, M.NO_GROUP_NAME)
        if slash + 1 > M.MAX_EVENT_NAME_LEN:
            raise cmd.error(0, offset, M.GROUP_TOO_LONG)
        group = name[:slash]
        if not is_good_name(group, hash_ok=True):
            raise cmd.error(0, offset, M.BAD_GROUP_NAME)
        offset += slash + 1
        name = name[slash + 1 :]
    if not name:
        if slash >= 0:
            return group, None
        raise cmd.error(0, offset, M.NO_EVENT_NAME)
    if len(name) >= M.MAX_EVENT_NAME_LEN:  # the name and its NUL must fit in MAX_EVENT_NAME_LEN
        raise cmd.error(0, offset, M.EVENT_TOO_LONG)
    if not is_good_name(name):
        raise cmd.error(0, offset, M.BAD_EVENT_NAME)
    return group, name


class _Probe(Protocol):
    text: str
    args: list[FetchArg]
    source: Definition | None

    @property
    def is_return(self) -> bool: ...  # read-only: ProbeEvent's is a property


def append_checks(new: _P, existing: Sequence[_P], dialect: Dialect, place: Callable[[_P], Hashable]) -> None:
    """``trace_probe_compare_arg_type`` and the same-probe check, shared by kprobe and uprobe events: the first
    probe's type and arguments, and no second probe at the same ``place`` with the same arguments."""
    if not existing:
        return
    cmd = Command(source_of(new), dialect)
    old = existing[0]
    if new.is_return != old.is_return:
        raise cmd.error(0, 0, M.DIFF_PROBE_TYPE)
    diff = _compare_arg_types(new.args, old.args)
    if diff:
        raise cmd.error(diff + 1, 0, M.DIFF_ARG_TYPE)
    for probe in existing:
        if place(probe) == place(new) and [a.body for a in probe.args] == [a.body for a in new.args]:
            raise cmd.error(0, 0, M.SAME_PROBE)


def source_of(probe: _Probe) -> Definition:
    """The definition a probe was parsed from; one made without its parse (a test's) is read from its text."""
    return probe.source if probe.source is not None else parse_definition(probe.text)


def _compare_arg_types(a: list[FetchArg], b: list[FetchArg]) -> int:
    """``trace_probe_compare_arg_type``: 1-based index of the first difference, or 0."""
    if len(a) != len(b):
        return min(len(a), len(b)) + 1
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x.type.name != y.type.name or x.type.array != y.type.array or x.name != y.name:
            return i + 1
    return 0
