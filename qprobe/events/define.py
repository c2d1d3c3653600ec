"""Defining events: a kprobe_events definition parsed, checked as the kernel checks it, and armed.

``add_event`` parses a definition exactly as the kernel's kprobe_events would and
arms its probe; ``add_events`` arms one definition on a glob as one event per
function; ``remove_events`` disarms.  The refusals are the kernel's (its texts and
carets, ``error_log`` style).  They work on an :class:`EventRegistry`, the narrow
view of the target they are given (qprobe.eventapi.EventAPI is the one a Target holds).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypedDict

from qprobe.errors import (
    FetchArgError,
    InvalidProbe,
    NotInstructionBoundary,
    NotKernelText,
    ProbeError,
    QprobeError,
    SymbolError,
)
from qprobe.events.event import TraceEvent, event_filter
from qprobe.events.funcs import Probeability, check_probe_symbol, did_you_mean, wildcard_definitions
from qprobe.events.hit import EventHit
from qprobe.events.kprobe import KprobeEvent, KprobeHost
from qprobe.events.samples import SampleCb
from qprobe.events.uprobe import UprobeHost, UprobeTraceEvent
from qprobe.fetch import (
    Definition,
    Glob,
    ProbeEvent,
    UprobeEvent,
    check_append,
    check_event,
    check_uprobe_append,
    is_glob,
    parse_definition,
    parse_event,
    parse_uprobe_event,
)
from qprobe.fetch import messages as M
from qprobe.fetch.command import source_of
from qprobe.fetch.kstrto import kstrtoul
from qprobe.kernel.tracefs import within_notrace_func
from qprobe.kernel.usyntax import resolve_uprobe_symbols

if TYPE_CHECKING:
    from qprobe.events.registry import ModuleWatch
    from qprobe.fetch import DeleteEvent
    from qprobe.fetch.dialect import Dialect
    from qprobe.fetch.uevent import FileKind

log = logging.getLogger("qprobe.events")


class EventRegistry(KprobeHost, UprobeHost, Protocol):
    """What defining an event checks against and records it in: the events table, the kernel's
    kprobe_events language, its trace events and ftrace sites, the modules followed, the guest's files."""

    events: dict[str, TraceEvent]

    @property
    def modules(self) -> ModuleWatch: ...
    @property
    def dialect(self) -> Dialect: ...
    @property
    def ftrace_locations(self) -> list[int]: ...
    @property
    def trace_events(self) -> frozenset[tuple[str, str]]: ...
    def user_file_kind(self, path: str) -> FileKind: ...
    def resolve_user_symbol(self, path: str, spec: str) -> int: ...


def on_func_entry(reg: EventRegistry, symbol: str, offset: int) -> bool:
    """``kprobe_on_func_entry``: is ``symbol+offset`` the entry of the function that contains it?

    The kernel resolves the address to the kallsyms symbol containing it (so
    ``ksys_lseek+SIZE`` is the next function's entry) and, on x86, counts the
    byte after an ``endbr64`` as the entry too (``arch_adjust_kprobe_addr``).
    """
    addr = reg.symbols.address(symbol) + offset
    sym = reg.symbols.containing(addr)
    return sym is not None and addr - sym.addr in (0, reg.kprobe_backend.entry_skip(sym.addr))


def definition_of(definition: str | Definition) -> Definition:
    """The definition parsed: text is read once here, a Definition taken as it is."""
    return definition if isinstance(definition, Definition) else parse_definition(definition)


def is_wildcard(definition: Definition | ProbeEvent) -> bool:
    """Whether a definition's probe point is a glob: one event per function (``add_events``)."""
    if isinstance(definition, ProbeEvent):
        return definition.symbol is not None and is_glob(definition.symbol)
    return definition.is_wildcard


def _suggesting(reg: EventRegistry, definition: Definition, exc: FetchArgError) -> FetchArgError:
    """The kernel's refusal of an unknown probe symbol, with the names it was probably meant to be."""
    symbol = definition.place_name
    if exc.detail or symbol is None or exc.column != definition.point_column:
        return exc
    if not symbol or symbol in reg.symbols or kstrtoul(symbol, 0) is not None:
        return exc
    if is_glob(symbol):
        detail = "a wildcard makes one event per function: add_events()"
        return FetchArgError(exc.reason, exc.text, exc.column, logged=exc.logged, detail=detail)
    hint = did_you_mean(reg.symbols.names(), symbol)
    return FetchArgError(exc.reason, exc.text, exc.column, logged=exc.logged, detail=f"no symbol {symbol!r}{hint}")


def _follow_modules(reg: EventRegistry, definition: Definition) -> None:
    """Know the guest's modules before a definition whose probe point may be in one is checked.

    ``MOD:SYM`` names a module's symbol; a plain name vmlinux lacks may be one
    (kallsyms_lookup_name searches modules after vmlinux).  Without the
    kernel's debug info a plain name stays unknown, and ``MOD:SYM`` is refused.
    """
    name = definition.place_name
    if name is None or definition.kind not in ("p", "r"):
        return
    if not name or name[0].isdigit() or is_glob(name) or name in reg.symbols or reg.modules.started:
        return
    try:
        reg.modules.start()
    except SymbolError:
        if ":" in name:
            raise
        log.debug("modules not followed", exc_info=True)


def _registration_error(ev: ProbeEvent, exc: ProbeError | SymbolError, dialect: Dialect) -> FetchArgError:
    """What ``__trace_kprobe_create`` logs when register_kprobe fails, with qprobe's reason as detail."""
    if isinstance(exc, NotInstructionBoundary):
        message = M.BAD_INSN_BNDRY  # -EILSEQ
    elif isinstance(exc, SymbolError):
        message = M.BAD_PROBE_ADDR  # -ENOENT
    else:
        message = M.FAIL_REG_PROBE  # -EINVAL, -EBUSY...
    return FetchArgError(dialect.message(message), ev.text, source_of(ev).point_column, detail=str(exc))


def add_event(
    reg: EventRegistry,
    definition: str | Definition | ProbeEvent | UprobeEvent,
    callback: Callable[[EventHit], None] | None = None,
    filter: str | None = None,
    anywhere: bool = False,
    sample_cb: SampleCb | None = None,
) -> TraceEvent:
    """Parse a kprobe_events or uprobe_events definition (or take one parsed) and arm it; raises FetchArgError
    naming the problem.  With ``sample_cb`` (an event recorded in the guest) its hits go to that ring
    handler in batches instead of ``callback`` (qprobe.events.samples).

    Refusals are the kernel's (its texts and carets, ``error_log`` style), including
    those it makes when it adds the probe to its event table or registers it;
    ``anywhere`` arms it with a stub breakpoint (``Kprobe(anywhere=True)``; a uprobe always is one).
    The text is parsed once (``parse_definition``); every step after takes the parsed form.
    """
    if isinstance(definition, str):
        definition = parse_definition(definition)
    if isinstance(definition, UprobeEvent) or (isinstance(definition, Definition) and definition.is_uprobe):
        return _add_uprobe_event(reg, definition, callback, filter, sample_cb)
    _follow_modules(reg, source_of(definition) if isinstance(definition, ProbeEvent) else definition)
    te, first = _prepare(reg, definition, callback, filter, reg.symbols.count, anywhere, sample_cb)
    try:
        te.backend.register([te])
    except (ProbeError, SymbolError) as exc:
        ev, symbols = te.definition, reg.symbols
        # Address 0 is no address at all: _kprobe_addr's "!symbol_name && !addr" is -EINVAL, not -ENOENT.
        unknown_addr = ev.symbol is None and bool(ev.addr) and symbols.containing(ev.addr or 0) is None
        if (isinstance(exc, NotKernelText) and unknown_addr) or (
            isinstance(exc, SymbolError) and ev.symbol is not None and ev.symbol.split(":")[0] not in symbols.modules
        ):
            # A symbol or address kallsyms does not know is -ENOENT, which the kernel takes for a
            # module's function not loaded yet: the event is created and its probe stays unregistered
            # (for MOD:SYM, until that module loads).
            log.warning("%s: This probe might be able to register after target module is loaded. Continue.",
                        te.name)  # fmt: skip
            te.probe = None
        else:
            raise _registration_error(ev, exc, reg.dialect) from exc
    if first is not None:
        first.appended.append(te)
    else:
        reg.events[te.name] = te
    return te


def _add_uprobe_event(reg: EventRegistry, definition: Definition | UprobeEvent,
                      callback: Callable[[EventHit], None] | None, filter: str | None,
                      sample_cb: SampleCb | None = None) -> TraceEvent:  # fmt: skip
    """A uprobe_events definition (``PATH:SYMBOL[+OFFS]`` resolved first, from the file's ELF) armed as a Uprobe."""
    dialect = reg.dialect
    if isinstance(definition, UprobeEvent):
        ev: UprobeEvent | object = definition
        text = definition.text
    else:
        try:
            resolved = resolve_uprobe_symbols(definition, reg.resolve_user_symbol)
        except QprobeError as exc:
            raise FetchArgError(str(exc), definition.text, definition.point_column, logged=False) from None
        text = resolved.text
        ev = parse_uprobe_event(resolved, dialect, file_check=reg.user_file_kind)
    if not isinstance(ev, UprobeEvent):
        raise FetchArgError("use remove_event() to delete an event", text, 0, logged=False)
    name = f"{ev.group}/{ev.event}"
    first = reg.events.get(name)
    if first is not None and not isinstance(first, UprobeTraceEvent):
        raise FetchArgError(dialect.message(M.EVENT_EXIST), text, 0)
    check_uprobe_append(ev, [te.definition for te in first.probes()] if first else [], dialect)  # type: ignore[misc]
    if first is None and (ev.group, ev.event) in reg.trace_events:
        raise FetchArgError(dialect.message(M.EVENT_EXIST), text, 0)
    te = UprobeTraceEvent(reg, ev, callback, filter=None if filter is None else event_filter(ev, filter),  # type: ignore[arg-type]
                          sample_cb=sample_cb)  # fmt: skip
    te.make_probe()
    try:
        te.backend.register([te])
    except (ProbeError, SymbolError) as exc:
        raise FetchArgError(dialect.message(M.FAIL_REG_PROBE), text, source_of(ev).point_column, logged=False,
                            detail=str(exc)) from None  # fmt: skip
    if first is not None:
        first.appended.append(te)
    else:
        reg.events[te.name] = te
    return te


@dataclass
class Wildcard:
    """The events a definition on a glob made: one per function that could be probed, and the refusals."""

    pattern: str
    events: list[TraceEvent]
    refused: dict[str, str]  # function -> why it was not probed


MAX_WILDCARD = 1000  # probes one glob may arm: more is almost always a pattern wider than meant


def add_events(
    reg: EventRegistry,
    definition: str | Definition | ProbeEvent,
    callback: Callable[[EventHit], None] | None = None,
    filter: str | None = None,
    anywhere: bool = False,
) -> Wildcard:
    """A definition whose probe point is a glob (``p:vfs vfs_* fd=%di``): every match that can be probed, at once.

    Each function gets its own event (see ``wildcard_definitions``); the ones the kernel
    would refuse (notrace, blacklisted, not unique...) or whose definition it would refuse
    are counted in ``refused`` with the reason.  The probes are registered as one batch.
    """
    parsed = source_of(definition) if isinstance(definition, ProbeEvent) else definition_of(definition)
    point = parsed.point
    pattern = point.pattern if isinstance(point, Glob) else parsed.place_name or ""
    prob = Probeability.of_sites(reg, reg.kprobe_backend.sites)
    # While the kernel boots every probe goes on a stub breakpoint; those the int3 path refuses stay so.
    prob.anywhere = anywhere or reg.kprobe_backend.booting
    found = check_probe_symbol(prob, pattern)
    if not found:
        raise FetchArgError("not a wildcard: use add_event()", parsed.text, parsed.point_column)
    refused = {f.name: f.reason for f in found if f.reason is not None}
    definitions = wildcard_definitions(parsed, [f.name for f in found if f.reason is None])
    if len(definitions) > MAX_WILDCARD:
        raise ProbeError(f"{pattern!r} matches {len(definitions)} functions that can be probed; "
                         f"qprobe arms at most {MAX_WILDCARD} at once (narrow the pattern)")  # fmt: skip
    prepared: list[TraceEvent] = []
    for func, one in definitions:
        try:
            event, first = _prepare(reg, one, callback, filter, lambda _name: 1, anywhere)  # unique above
        except FetchArgError as exc:
            refused[func] = exc.explained
            continue
        if first is not None:
            refused[func] = f"{reg.dialect.message(M.EVENT_EXIST)} ({event.name})"
            continue
        prepared.append(event)
    try:
        _register_batch(prepared)
    except ProbeError:
        # One the host's checks passed was refused when registered: find which, one by one.
        armed: list[TraceEvent] = []
        for te in prepared:
            try:
                te.backend.register([te])
            except ProbeError as exc:
                refused[te.definition.symbol or ""] = str(exc)
                continue
            armed.append(te)
        prepared = armed
    for te in prepared:
        reg.events[te.name] = te
    return Wildcard(pattern, prepared, dict(sorted(refused.items())))


class _Answers(TypedDict):
    """The running kernel's answers to parse_event and check_event (their keyword arguments)."""

    symbol_exists: Callable[[str], bool]
    on_func_entry: Callable[[str, int], bool]
    dialect: Dialect
    symbol_count: Callable[[str], int]


def _prepare(
    reg: EventRegistry, definition: Definition | ProbeEvent, callback: Callable[[EventHit], None] | None,
    filter: str | None, symbol_count: Callable[[str], int], anywhere: bool, sample_cb: SampleCb | None = None,
) -> tuple[KprobeEvent, TraceEvent | None]:  # fmt: skip
    """The parsed (or, given parsed, checked), unregistered event, and the existing event it would join (or None).

    Parsed with the running kernel's answers (its symbols, which places are function entries);
    a definition a front end parsed already is checked with them, not parsed again (check_event).
    """
    symbols, dialect = reg.symbols, reg.dialect
    answers: _Answers = {"symbol_exists": lambda name: name in symbols, "dialect": dialect,
                         "symbol_count": symbol_count,
                         "on_func_entry": lambda sym, off: on_func_entry(reg, sym, off)}  # fmt: skip
    text = definition.text
    parsed = source_of(definition) if isinstance(definition, ProbeEvent) else definition
    try:
        if isinstance(definition, ProbeEvent):
            ev: ProbeEvent | DeleteEvent = check_event(definition, **answers)
        else:
            ev = parse_event(parsed, **answers)
    except FetchArgError as exc:
        raise _suggesting(reg, parsed, exc) from None
    if not isinstance(ev, ProbeEvent):
        raise FetchArgError("use remove_event() to delete an event", text, 0, logged=False)
    name = f"{ev.group}/{ev.event}"
    first = reg.events.get(name)
    # register_trace_kprobe: a definition naming an existing event appends a probe to it.
    check_append(ev, [te.definition for te in first.probes()] if first else [], dialect)
    if first is None and (ev.group, ev.event) in reg.trace_events:
        raise FetchArgError(dialect.message(M.EVENT_EXIST), text, 0)
    anywhere = check_notrace(reg, ev, anywhere)
    te = KprobeEvent(reg, ev, callback, filter=None if filter is None else event_filter(ev, filter),
                     anywhere=anywhere, sample_cb=sample_cb)  # fmt: skip
    te.make_probe()
    return te, first


def check_notrace(reg: EventRegistry, ev: ProbeEvent, anywhere: bool) -> bool:
    """``__register_trace_kprobe``'s "Could not probe notrace function" (-EINVAL), on each registration: when
    defined, and when a module's event is registered on its load (a module's ``.exit.text``, for one, has
    no ``__fentry__`` sites).  Returns whether the probe goes on a stub breakpoint for good: asked so, or a
    notrace function's armed while the kernel boots (only stub breakpoints work then; it stays one after,
    as the kernel refuses it)."""
    symbols = reg.symbols
    if not anywhere and ev.symbol is not None and ev.symbol in symbols and within_notrace_func(
            symbols, reg.ftrace_locations, symbols.address(ev.symbol) + ev.offset):  # fmt: skip
        if reg.kprobe_backend.booting:
            return True
        raise _registration_error(ev, InvalidProbe(f"{ev.symbol} is a notrace function (EINVAL)"), reg.dialect)
    return anywhere


def register_probe(te: TraceEvent) -> None:
    """Make the event's probe anew from its definition and register it (a module's event, when it loads)."""
    te.make_probe()
    te.backend.register([te])


def _by_backend(events: Iterable[TraceEvent]) -> list[list[TraceEvent]]:
    """The events grouped by the backend that holds their probes, in the order given."""
    groups: dict[int, list[TraceEvent]] = {}
    for te in events:
        groups.setdefault(id(te.backend), []).append(te)
    return list(groups.values())


def _register_batch(events: list[TraceEvent]) -> None:
    """All or nothing: each backend's probes in one batch (for kprobes, one grace period places every jump)."""
    done: list[list[TraceEvent]] = []
    try:
        for group in _by_backend(events):
            group[0].backend.register(group)
            done.append(group)
    except BaseException:
        for group in reversed(done):
            group[0].backend.unregister(group)
        raise


def remove_events(events: Iterable[TraceEvent]) -> None:
    """Disarm every probe of the events (each one's first definition and those appended to it).

    Each backend's go in one batch, as ``add_events`` armed them: for kprobes, one VM stop for any number.
    """
    for group in _by_backend(one for te in events for one in te.probes()):
        group[0].backend.unregister(group)
