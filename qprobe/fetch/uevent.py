"""Whole uprobe_events lines: ``p``/``r`` definitions on a user file and ``-:`` deletions.

A transcription of ``create_or_delete_trace_uprobe`` and ``__trace_uprobe_create``
(kernel/trace/trace_uprobe.c, the same in Linux 6.1 and 6.12 but for what the
shared argument parser and the :class:`~qprobe.fetch.dialect.Dialect` say):
``p|r[:[GRP/][EVENT]] PATH:OFFSET[%return][(REF_CTR_OFFSET)] [FETCHARGS]``.
Errors carry the kernel's error_log text and caret column, as kprobe_events'
do (:mod:`qprobe.fetch.event`).

The kernel looks the path up (``kern_path``, ``d_is_reg``) before it reads the
offset; that answer comes from ``file_check(path)``: ``"regular"``,
``"missing"`` or ``"other"`` (a directory, a device...).  Without it every path
is a regular file.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from qprobe.errors import FetchArgError

from . import messages as M
from .args import FetchArg, Value, integer_names, parse_fetch_arg, string_names
from .command import Command, append_checks, parse_event_name
from .context import UprobeContext, UserFetchContext
from .definition import Definition, parse_definition
from .dialect import BASE, Dialect
from .event import DeleteEvent, _parse_delete
from .expr import FL_RETURN, FL_USER, ArgError
from .kstrto import isdigit, kstrtoul

FileKind = Literal["regular", "missing", "other"]
FileCheck = Callable[[str], FileKind]


@dataclass
class UprobeEvent:
    """One uprobe or uretprobe definition: ``offset`` bytes into the file at ``path``.

    ``ref_ctr_offset`` is the file offset of an SDT semaphore the kernel
    counts up while the probe is armed (None: not given; the kernel stores 0
    then, and lists neither).
    """

    group: str
    event: str
    path: str
    offset: int
    ref_ctr_offset: int | None
    is_return: bool
    args: list[FetchArg] = field(default_factory=list)
    text: str = ""
    source: Definition | None = field(default=None, compare=False, repr=False)  # the text parsed, its words

    @property
    def kind(self) -> str:
        """``p`` or ``r``, as uprobe_events lists it."""
        return "r" if self.is_return else "p"

    @property
    def probe_point(self) -> str:
        """``PATH:0x%016lx[(0x%lx)]``: the place as uprobe_events lists it (and as ``-:`` matches it)."""
        ref = f"(0x{self.ref_ctr_offset:x})" if self.ref_ctr_offset else ""
        return f"{self.path}:0x{self.offset:016x}{ref}"

    @property
    def integer_args(self) -> frozenset[str]:
        """The arguments whose values are integers (not strings, arrays or bitfields' text)."""
        return integer_names(self.args)

    @property
    def string_args(self) -> frozenset[str]:
        """The arguments whose values are strings (``string``, ``ustring``, ``$comm``)."""
        return string_names(self.args)

    def evaluate(self, ctx: UserFetchContext) -> list[Value]:
        """Every argument's value at one hit, as trace_uprobe.c's fetch functions read them."""
        user = UprobeContext(ctx)
        return [a.evaluate(user) for a in self.args]


def parse_uprobe_event(
    text: str | Definition, dialect: Dialect = BASE, *, file_check: FileCheck | None = None
) -> UprobeEvent | DeleteEvent:
    """Parse one uprobe_events line as the kernel whose ``dialect`` is given would, or raise FetchArgError.

    A Definition is the line parsed already (``parse_definition``): it is not read again."""
    definition = text if isinstance(text, Definition) else parse_definition(text)
    text = definition.text
    raw = text[:-1] if text.endswith("\n") else text
    if len(raw.encode()) > M.WRITE_BUFSIZE - 2:
        raise FetchArgError(M.LINE_TOO_LONG, text, M.WRITE_BUFSIZE - 2, logged=False)
    cmd = Command(definition, dialect)
    if definition.kind == "-" and definition.words[0][0] == 0:  # the line starts with '-': a deletion
        return _parse_delete(cmd)
    if not cmd.argv:
        raise FetchArgError(M.EMPTY_COMMAND, text, 0, logged=False)
    argv = cmd.argv
    # -ECANCELED, which create_or_delete_trace_uprobe turns into -EINVAL with nothing logged.
    if argv[0][0] not in "pr" or len(argv) < 2 or "/" not in argv[1]:
        raise FetchArgError(M.NOT_A_UPROBE, text, 0, logged=False)
    colon = argv[1].rfind(":")  # the last one: a path may hold ':' too
    if colon < 0 or not isdigit(argv[1][colon + 1 : colon + 2]):
        raise FetchArgError(M.NOT_A_UPROBE, text, 0, logged=False)
    return _parse_probe(cmd, colon, file_check)


def parse_uprobe_events(
    text: str, dialect: Dialect = BASE, *, file_check: FileCheck | None = None
) -> list[UprobeEvent | DeleteEvent]:
    """Every non-empty line of a uprobe_events write, comments removed; stops at the first bad line."""
    definitions = [parse_definition(line) for line in text.split("\n")]
    return [parse_uprobe_event(d, dialect, file_check=file_check) for d in definitions if d.words]


def _parse_probe(cmd: Command, colon: int, file_check: FileCheck | None) -> UprobeEvent:
    argv = cmd.argv
    is_return = argv[0][0] == "r"
    # Only "p:" or "r:" names the event: "p1 ..." or "rfoo ..." is a probe with the default name.
    event: str | None = argv[0][2:] if argv[0][1:2] == ":" else None
    path, spec = argv[1][:colon], argv[1][colon + 1 :]
    at = colon + 1  # columns below count from the start of the second word, as the kernel's do from filename

    kind = file_check(path) if file_check is not None else "regular"
    if kind == "missing":
        raise cmd.error(1, 0, M.FILE_NOT_FOUND)
    if kind != "regular":
        raise cmd.error(1, 0, M.NO_REGULAR_FILE)

    ref_ctr: int | None = None
    paren = spec.find("(")
    if paren >= 0:
        close = spec.find(")", paren)
        if close < 0:
            raise cmd.error(1, at + len(spec), M.REFCNT_OPEN_BRACE)
        if close + 1 < len(spec):
            raise cmd.error(1, at + close + 1, M.BAD_REFCNT_SUFFIX)
        ref_ctr = kstrtoul(spec[paren + 1 : close], 0)
        if ref_ctr is None:
            raise cmd.error(1, at + paren + 1, M.BAD_REFCNT)
        spec = spec[:paren]

    pct = spec.find("%")
    if pct >= 0:
        if spec[pct:] != "%return":
            raise cmd.error(1, at + pct, M.BAD_ADDR_SUFFIX)
        is_return = True
        spec = spec[:pct]

    offset = kstrtoul(spec, 0)
    if offset is None:
        raise cmd.error(1, at, M.BAD_UPROBE_OFFS)

    group = M.UPROBE_EVENT_SYSTEM
    if event is not None:
        parsed_group, event = parse_event_name(cmd, event, 2)
        group = parsed_group or group
    if event is None:
        event = default_event_name(path, offset)

    words = argv[2:]
    if len(words) > M.MAX_TRACE_ARGS and cmd.dialect.meta_args:
        # Linux 6.5's parser counts the arguments first (-E2BIG, logged from 6.15); 6.1 parses the
        # first MAX_TRACE_ARGS and ignores the rest.
        raise cmd.error(2, 0, M.TOO_MANY_ARGS, logged=cmd.dialect.has(M.TOO_MANY_ARGS))
    flags = (FL_RETURN if is_return else 0) | FL_USER
    args: list[FetchArg] = []
    for i, word in enumerate(words[: M.MAX_TRACE_ARGS]):
        try:
            args.append(parse_fetch_arg(word, i, flags, args, cmd.dialect, None))
        except ArgError as exc:
            raise cmd.error(i + 2, exc.offset, exc.message, exc.logged) from None
    return UprobeEvent(group, event, path, offset, ref_ctr, is_return, args, cmd.text, cmd.definition)


def default_event_name(path: str, offset: int) -> str:
    """``p_<basename up to its first '.', '-' or '_'>_0x<offset>``, cut to 63 characters.

    The kernel names return probes ``p_`` too, and does not check the name
    against the C-identifier rule it applies to the names users give.
    """
    tail = path[path.rfind("/") + 1 :]
    cut = min((i for i in (tail.find("."), tail.find("-"), tail.find("_")) if i >= 0), default=len(tail))
    return f"p_{tail[:cut]}_0x{offset:x}"[: M.MAX_EVENT_NAME_LEN - 1]


def check_uprobe_append(new: UprobeEvent, existing: Sequence[UprobeEvent], dialect: Dialect = BASE) -> None:
    """Can ``new`` join the event whose probes are ``existing`` (same group/event)?

    ``register_trace_uprobe`` / ``append_trace_uprobe``: the probe type must
    match, the arguments must have the same names and types as the first
    probe's, and the same place (file and offset) with the same arguments
    cannot be added twice.  Places are compared by path, where the kernel
    compares inodes.
    """
    append_checks(new, existing, dialect, lambda probe: (probe.path, probe.offset))
