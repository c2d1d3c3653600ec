"""Whole kprobe_events lines: ``p``/``r`` definitions and ``-:`` deletions.

A transcription of ``create_or_delete_trace_kprobe``,
``__trace_kprobe_create`` (kernel/trace/trace_kprobe.c) and
``dyn_event_release`` of Linux 6.1; what uprobe_events lines share with them
(the event name, the append checks) is :mod:`qprobe.fetch.command`'s, and the
words rewritten before the arguments are parsed :mod:`qprobe.fetch.expand`'s.
Errors carry the column of the kernel's error_log caret, counted in the text
the caller gave (the kernel counts in its argv re-joined with single spaces;
with single spaces the two agree).

What the kernel only learns when it registers the probe (does the symbol
exist, is the offset a function entry) comes from the optional
``symbol_exists`` and ``on_func_entry`` callables; without them every
non-empty symbol exists and only offset 0 is a function entry (an
ENDBR-prefixed function also has its entry at +4: pass ``on_func_entry``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from qprobe.errors import FetchArgError

from . import messages as M
from .args import FetchArg, Value, integer_names, parse_fetch_arg, string_names, symbol_refs_of
from .command import Command, append_checks, parse_event_name, source_of
from .context import FetchContext
from .definition import Definition, parse_definition, strip_line
from .dialect import BASE, Dialect
from .expand import expand_dentry_arg, expand_meta_args
from .expr import FL_FENTRY, FL_KERNEL, FL_RETURN, ArgError, split_symbol_offset
from .kstrto import isdigit, kstrtouint, kstrtoul

SymbolExists = Callable[[str], bool]
SymbolCount = Callable[[str], int]
OnFuncEntry = Callable[[str, int], bool]


@dataclass
class ProbeEvent:
    """One kprobe or kretprobe definition.

    ``symbol`` is None for a probe on an address (then ``addr`` is set).
    ``SYM%return`` is stored as ``kind == "r"``, as the kernel does, so it is
    listed back as an ``r`` event.  ``maxactive`` 0 means the default.
    """

    kind: str
    group: str
    event: str
    symbol: str | None
    offset: int
    addr: int | None
    maxactive: int = 0
    args: list[FetchArg] = field(default_factory=list)
    text: str = ""
    # The language it was parsed in, and whether its place was taken for a function entry then (which
    # decides how its arguments parse): check_event parses it again only where a kernel's answers differ.
    dialect: Dialect = field(default=BASE, compare=False, repr=False)
    fentry: bool = False
    source: Definition | None = field(default=None, compare=False, repr=False)  # the text parsed, its words

    @property
    def integer_args(self) -> frozenset[str]:
        """The arguments whose values are integers (not strings, symbols, arrays or bitfields' text)."""
        return integer_names(self.args)

    @property
    def string_args(self) -> frozenset[str]:
        """The arguments whose values are strings (``string``, ``ustring``, ``symstr``, ``$comm``)."""
        return string_names(self.args)

    @property
    def is_return(self) -> bool:
        """True for a kretprobe (``r`` or ``%return``)."""
        return self.kind == "r"

    @property
    def probe_point(self) -> str:
        """The place as ``kprobe_events`` shows it: ``sym``, ``sym+16`` or ``0x...``."""
        if self.symbol is None:
            return f"0x{self.addr or 0:016x}"
        return f"{self.symbol}+{self.offset}" if self.offset else self.symbol

    def evaluate(self, ctx: FetchContext) -> list[Value]:
        """Every argument's value at one hit, in order."""
        return [a.evaluate(ctx) for a in self.args]


@dataclass
class DeleteEvent:
    """``-:[GRP/][EVENT] [probe-point [args...]]``.

    ``group`` None matches every group; ``event`` "" matches every event of
    the group; ``args`` (optional) must match the head of the definition.
    """

    group: str | None
    event: str
    args: list[str] = field(default_factory=list)
    text: str = ""

    def matches(self, ev: ProbeEvent) -> bool:
        """``trace_kprobe_match``: would this command delete ``ev``?"""
        if self.event and self.event != ev.event:
            return False
        if self.group is not None and self.group != ev.group:
            return False
        if not self.args:
            return True
        if self.args[0] != ev.probe_point or len(ev.args) < len(self.args) - 1:
            return False
        wanted = self.args[1:]
        have = [f"{a.name}={a.body}"[: M.MAX_ARGSTR_LEN] for a in ev.args[: len(wanted)]]
        return have == wanted


# What perf probe takes as its first word: [EVENT=]FUNC[@SRC][:RLN|+OFFS|%return|;PTN] or SRC:ALN.
_PERF_PLACE = re.compile(r"(?:[A-Za-z_]\w*=)?[A-Za-z_][\w.]+(?:@[\w./-]+)?(?:[:+%;]\S*)?")


def parse_event(
    text: str | Definition,
    *,
    symbol_exists: SymbolExists | None = None,
    on_func_entry: OnFuncEntry | None = None,
    dialect: Dialect = BASE,
    symbol_count: SymbolCount | None = None,
) -> ProbeEvent | DeleteEvent:
    """Parse one kprobe_events line as Linux 6.1 would, or raise FetchArgError.

    ``symbol_exists(name)`` answers for probe symbols (``[MOD:]SYM``) and for
    ``@SYM`` arguments; ``on_func_entry(symbol, offset)`` says whether that
    place is the function entry (for ``$argN`` and return probes); ``dialect``
    is what the running kernel adds to 6.1.0's language and how it words errors;
    ``symbol_count(name)`` is how many kallsyms entries have that name.  A Definition is the line parsed
    already (``parse_definition``): it is not read again.
    """
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
    head = cmd.argv[0]
    if head[0] not in "pr":
        if _PERF_PLACE.fullmatch(head):  # `vfs_read count`: perf probe's language, typed without its word
            perf = strip_line(text).strip()
            raise FetchArgError(f"{M.NOT_A_PROBE}; in perf probe's language write: perf {perf}", text, 0, logged=False)
        raise cmd.error(0, 0, M.NOT_A_PROBE)
    if len(cmd.argv) < 2:
        raise cmd.error(1, 0, M.NO_PROBE_POINT)
    return _parse_probe(cmd, symbol_exists, on_func_entry, symbol_count)


def parse_events(
    text: str,
    *,
    symbol_exists: SymbolExists | None = None,
    on_func_entry: OnFuncEntry | None = None,
    dialect: Dialect = BASE,
    symbol_count: SymbolCount | None = None,
) -> list[ProbeEvent | DeleteEvent]:
    """Every non-empty line of a kprobe_events write, comments removed.

    Stops at the first bad line, as the kernel's trace_parse_run_command does.
    """
    out: list[ProbeEvent | DeleteEvent] = []
    for line in text.split("\n"):
        definition = parse_definition(line)
        if definition.words:
            out.append(parse_event(definition, symbol_exists=symbol_exists, on_func_entry=on_func_entry,
                                   dialect=dialect, symbol_count=symbol_count))  # fmt: skip
    return out


def _parse_delete(cmd: Command) -> DeleteEvent:
    head = cmd.argv[0]
    if head[1:2] != ":":
        raise cmd.error(0, 0, M.BAD_DELETE)
    event = head[2:]
    group = None
    slash = event.find("/")
    if slash >= 0:
        group, event = event[:slash], event[slash + 1 :]
    if group is None and not event:
        raise cmd.error(0, 0, M.BAD_DELETE)
    return DeleteEvent(group, event, cmd.argv[1:], cmd.text)


def _parse_probe(
    cmd: Command, symbol_exists: SymbolExists | None, on_func_entry: OnFuncEntry | None,
    symbol_count: SymbolCount | None,
) -> ProbeEvent:  # fmt: skip
    argv = cmd.argv
    head = argv[0]
    is_return = head[0] == "r"
    flags = FL_KERNEL
    colon = head.find(":", 1)
    event: str | None = head[colon + 1 :] if colon >= 0 else None
    maxactive = 0
    if isdigit(head[1:2]):
        if not is_return:
            raise cmd.error(0, 1, M.MAXACT_NO_KPROBE)
        digits = head[1:colon] if colon >= 0 else head[1:]
        value = kstrtouint(digits, 0) if len(digits) <= M.MAX_EVENT_NAME_LEN - 1 else None
        if not value:
            raise cmd.error(0, 1, M.BAD_MAXACT)
        if value > M.KRETPROBE_MAXACTIVE_MAX:
            raise cmd.error(0, 1, M.MAXACT_TOO_BIG)
        maxactive = value

    symbol: str | None = None
    offset = 0
    exists = True
    addr = kstrtoul(argv[1], 0)
    if addr is None:
        if "/" in argv[1] and ":" in argv[1]:
            raise cmd.error(1, 0, M.UPROBE_SYNTAX)
        symbol = argv[1]
        pct = symbol.find("%")
        if pct >= 0:
            if symbol[pct:] != "%return":
                raise cmd.error(1, pct, M.BAD_ADDR_SUFFIX)
            symbol = symbol[:pct]
            is_return = True
        symbol, parsed = split_symbol_offset(symbol)
        if parsed is None or not 0 <= parsed <= M.UINT_MAX:
            raise cmd.error(1, 0, M.BAD_PROBE_ADDR)
        offset = parsed
        _check_unique(cmd, symbol, symbol_count)
        if is_return:
            flags |= FL_RETURN
        exists, fentry = _place(cmd, symbol, offset, is_return, symbol_exists, on_func_entry)
        if fentry:
            flags |= FL_FENTRY

    group = M.KPROBE_EVENT_SYSTEM
    if event is not None:
        parsed_group, event = parse_event_name(cmd, event, colon + 1)
        group = parsed_group or group
    if event is None:
        event = _default_event_name(is_return, symbol, offset, addr)

    words = argv[2:]
    if cmd.dialect.meta_args:
        words = expand_meta_args(cmd, words, flags, symbol)
    if cmd.dialect.dentry_args:
        words = [expand_dentry_arg(cmd, w) if w.endswith((":%pd", ":%pD")) else w for w in words]
    if len(words) > M.MAX_TRACE_ARGS and cmd.dialect.meta_args:
        # Linux 6.5 on counts the arguments (after $arg* made more of them) before it parses one: -E2BIG,
        # logged from 6.15.  Before, the parser took the first MAX_TRACE_ARGS and ignored the rest.
        raise cmd.error(2, 0, M.TOO_MANY_ARGS, logged=cmd.dialect.has(M.TOO_MANY_ARGS))
    args: list[FetchArg] = []
    for i, word in enumerate(words[: M.MAX_TRACE_ARGS]):
        try:
            args.append(parse_fetch_arg(word, i, flags, args, cmd.dialect, symbol))
        except ArgError as exc:
            # Carets count in the words as written, even after $arg* made more of them (as the kernel's log does).
            raise cmd.error(i + 2, exc.offset, exc.message, exc.logged) from None

    _check_registration(cmd, symbol, exists, args, symbol_exists)
    return ProbeEvent(
        kind="r" if is_return else "p",
        group=group,
        event=event,
        symbol=symbol,
        offset=offset,
        addr=addr,
        maxactive=maxactive,
        args=args,
        text=cmd.text,
        dialect=cmd.dialect,
        fentry=bool(flags & FL_FENTRY),
        source=cmd.definition,
    )


def check_event(
    ev: ProbeEvent,
    *,
    symbol_exists: SymbolExists | None = None,
    on_func_entry: OnFuncEntry | None = None,
    dialect: Dialect = BASE,
    symbol_count: SymbolCount | None = None,
) -> ProbeEvent:
    """``ev`` checked as ``parse_event`` checks a definition with these answers: the same errors.

    A definition parsed once before a kernel's symbols were at hand (a front end's, before
    the VM boots) is not parsed again: only what those answers decide is checked, and ``ev``
    returned.  It is parsed again from its text where they change how it parses: another
    language (``dialect``), a place the kernel takes for a function entry where the first
    parse did not (or the other way), or a module's function (whose BTF only the running
    kernel has).
    """
    again = ev.dialect != dialect or (ev.symbol is not None and ":" in ev.symbol)
    cmd = Command(source_of(ev), dialect)
    exists = True
    if not again and ev.symbol is not None:
        _check_unique(cmd, ev.symbol, symbol_count)
        exists, fentry = _place(cmd, ev.symbol, ev.offset, ev.is_return, symbol_exists, on_func_entry)
        again = fentry != ev.fentry
    if again:
        parsed = parse_event(cmd.definition, symbol_exists=symbol_exists, on_func_entry=on_func_entry, dialect=dialect,
                             symbol_count=symbol_count)  # fmt: skip
        assert isinstance(parsed, ProbeEvent), "a definition parses as one"
        return parsed
    _check_registration(cmd, ev.symbol, exists, ev.args, symbol_exists)
    return ev


def _check_unique(cmd: Command, symbol: str, symbol_count: SymbolCount | None) -> None:
    if symbol_count is not None and cmd.dialect.has(M.NON_UNIQ_SYMBOL):
        # validate_probe_symbol (Linux 6.5's "tracing/kprobes: Return EADDRNOTAVAIL when func matches
        # several symbols", backported to stable kernels): known where the kernel logs its text.
        count = symbol_count(symbol)
        if count != 1:
            raise cmd.error(1, 0, M.NON_UNIQ_SYMBOL if count > 1 else M.BAD_PROBE_ADDR)


def _place(cmd: Command, symbol: str, offset: int, is_return: bool, symbol_exists: SymbolExists | None,
           on_func_entry: OnFuncEntry | None) -> tuple[bool, bool]:  # fmt: skip
    """(does the symbol exist, is the place a function entry for the arguments: FL_FENTRY)."""
    exists = bool(symbol) and (symbol_exists is None or symbol_exists(symbol))
    if not exists:  # kprobe_on_func_entry() is -ENOENT: decided later
        return False, False
    entry = on_func_entry(symbol, offset) if on_func_entry else offset == 0
    if is_return and not entry:
        raise cmd.error(1, 0, M.BAD_RETPROBE)
    return True, entry and not is_return  # a return probe is never "at the entry" (6.1's $argN wants neither)


def _check_registration(cmd: Command, symbol: str | None, exists: bool, args: list[FetchArg],
                        symbol_exists: SymbolExists | None) -> None:  # fmt: skip
    """What registration (traceprobe_update_arg, register_kprobe) would reject."""
    for _, ref in symbol_refs_of(args):
        if ref.offset is None:
            raise cmd.error(1, 0, M.FAIL_REG_PROBE)
        if not ref.name or (symbol_exists is not None and not symbol_exists(ref.name)):
            raise cmd.error(1, 0, M.BAD_PROBE_ADDR)
    if not exists and ":" not in (symbol or ""):
        # MOD:SYM is looked up when it is registered: a module not loaded yet keeps it pending.
        raise cmd.error(1, 0, M.BAD_PROBE_ADDR)


def _default_event_name(is_return: bool, symbol: str | None, offset: int, addr: int | None) -> str:
    """``p_SYM_OFFS`` / ``r_0xADDR``, cut to 63 chars, ``:`` and ``.`` made ``_``.

    The kernel prints the address with ``%p``, which is a hashed value unless
    the guest boots with no_hash_pointers; qprobe uses the real address.
    """
    kind = "r" if is_return else "p"
    name = f"{kind}_{symbol}_{offset}" if symbol is not None else f"{kind}_0x{addr or 0:016x}"
    name = name[: M.MAX_EVENT_NAME_LEN - 1]
    return name[0] + name[1:].replace(":", "_").replace(".", "_")


def check_append(new: ProbeEvent, existing: Sequence[ProbeEvent], dialect: Dialect = BASE) -> None:
    """Can ``new`` join the event whose probes are ``existing`` (same group/event)?

    Mirrors register_trace_kprobe / append_trace_kprobe: the probe type must
    match, the arguments must have the same names and types as the first
    existing probe, and the same place with the same arguments cannot be
    added twice (probes on addresses all count as the same place, "unknown",
    as in the kernel).  Raises FetchArgError with the kernel's caret.
    """
    append_checks(new, existing, dialect, lambda probe: (probe.symbol or "unknown", probe.offset))
