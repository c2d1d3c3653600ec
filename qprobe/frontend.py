"""The definition front end the CLI and the shell share: which language an EVENT's text is in (kprobe_events,
uprobe_events, perf probe's, perf's ``-x`` and bpftrace's ``uprobe:`` forms), and what each becomes for the
events layer (the kprobe_events line perf would write, a Definition, a ProbeEvent or UprobeEvent)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from qprobe.errors import FetchArgError

if TYPE_CHECKING:
    from qprobe.arch import Arch, RegisterLayout
    from qprobe.fetch import Definition, ProbeEvent, UprobeEvent
    from qprobe.fetch.dialect import Dialect
    from qprobe.kernel.symbols import Symbols
    from qprobe.kernel.usyntax import Resolve

T = TypeVar("T")


def is_kernel_perf(text: str) -> bool:
    """A perf probe definition of the kernel's (``perf -x PATH`` is a program's: a uprobe)."""
    from qprobe.kernel.perfsyntax import is_perf_definition
    from qprobe.kernel.usyntax import is_user_form

    return is_perf_definition(text) and not is_user_form(text)


def perf_to_kprobe_events(texts: list[str], symbols: Symbols, arch: Arch) -> list[str]:
    """Kernel perf probe definitions as the kprobe_events lines perf would write, in order, resolved from
    vmlinux's DWARF."""
    from qprobe.events.funcs import Probeability, unknown_symbol
    from qprobe.kernel.perfprobe import perf_to_kprobe
    from qprobe.kernel.perfsyntax import parse_perf_probe

    probes = []
    for text in texts:  # each parsed once; a typo gets the closest names, as a kprobe_events definition's does
        probe = parse_perf_probe(text)
        if probe.function is not None and probe.function not in symbols:
            raise unknown_symbol(symbols, probe.function, Probeability.of(symbols, arch).functions())
        probes.append(probe)
    return [found.definition for found in perf_to_kprobe(probes, symbols, arch)]


def parse_definitions(
    texts: list[str], dialect: Dialect, registers: RegisterLayout,
    fetch_error: Callable[[FetchArgError], FetchArgError] = lambda exc: exc,
) -> tuple[list[str | Definition | ProbeEvent], list[ProbeEvent | UprobeEvent]]:  # fmt: skip
    """Texts parsed in a kernel's language: what goes down to the target, and the definitions as parsed here.

    A uprobe's definition (its probe point a guest path) goes down parsed but unchecked, perf's ``-x`` and
    bpftrace's ``uprobe:`` forms as text: their files and symbols are the guest's, so the kernel's checks of
    them come once booted; the rest of the line is judged here, a symbol standing in as offset 0.
    ``fetch_error`` rewords a kprobe's FetchArgError (the CLI's says when BTF is missing).
    """
    from qprobe.fetch import ProbeEvent, UprobeEvent, parse_definition, parse_event, parse_uprobe_event
    from qprobe.kernel.usyntax import is_user_form, symbolic_user_form, unresolved_syntax

    out: list[str | Definition | ProbeEvent] = []
    checked: list[ProbeEvent | UprobeEvent] = []
    for text in texts:
        user_form = is_user_form(text)
        try:
            definition = parse_definition(symbolic_user_form(text, registers) if user_form else text)
        except FetchArgError as exc:
            raise fetch_error(exc) from None
        if definition.is_uprobe:
            try:
                uev = parse_uprobe_event(unresolved_syntax(definition), dialect)
            except FetchArgError as exc:
                raise FetchArgError(exc.reason, definition.text, exc.column, logged=exc.logged,
                                    detail=exc.detail) from None  # fmt: skip
            if isinstance(uev, UprobeEvent):
                checked.append(uev)
            out.append(text if user_form else definition)
            continue
        try:
            ev = parse_event(definition, dialect=dialect)
        except FetchArgError as exc:
            raise fetch_error(exc) from None
        if isinstance(ev, ProbeEvent):
            checked.append(ev)
        # A deletion is refused once armed, as the API does.
        out.append(ev if isinstance(ev, ProbeEvent) else definition)
    return out, checked


def user_form_line(text: str, resolve: Resolve, registers: RegisterLayout, show: Callable[[str], None]) -> str:
    """perf's ``-x`` or bpftrace's ``uprobe:`` form as the uprobe_events line it makes, its symbol resolved in
    the guest's file by ``resolve``, the line handed to ``show`` (as ``perf probe -v`` shows what it writes)."""
    from qprobe.kernel.usyntax import user_form_definition

    line = user_form_definition(text, resolve, registers)
    show(line)
    return line


def resolve_user_forms(definitions: list[T], resolve: Resolve, registers: RegisterLayout,
                       show: Callable[[str], None]) -> list[T | str]:  # fmt: skip
    """The definitions with each of perf's ``-x`` and bpftrace's ``uprobe:`` forms made its uprobe_events line
    (user_form_line), the others as they are."""
    from qprobe.kernel.usyntax import is_user_form

    return [user_form_line(d, resolve, registers, show) if isinstance(d, str) and is_user_form(d) else d
            for d in definitions]  # fmt: skip


__all__ = ["is_kernel_perf", "parse_definitions", "perf_to_kprobe_events", "resolve_user_forms", "user_form_line"]
