"""EVENT definitions: perf's translated, each parsed and its function checked on the host before a VM boots,
then armed on the target (a uprobe's user forms resolved in the guest's files)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from qprobe.errors import QprobeError

from .host import _host_language, _host_probeability, _host_symbols, _without_btf

if TYPE_CHECKING:
    from qprobe.api import Target
    from qprobe.events import EventHit, TraceEvent
    from qprobe.fetch import Definition, ProbeEvent, UprobeEvent


def _perf_definitions(args: argparse.Namespace) -> None:
    """``perf ...`` EVENTs (perf probe's language) become the kprobe_events lines perf would write, shown.

    They are resolved from vmlinux's DWARF on the host, before anything boots.
    """
    from qprobe.frontend import is_kernel_perf, perf_to_kprobe_events

    texts = [t for t in args.events if is_kernel_perf(t)]
    if not texts:
        return
    symbols = _host_symbols(args)
    if symbols is None:
        raise QprobeError("a perf definition is resolved from vmlinux's debug information: give --vmlinux")
    from qprobe.wiring import vmlinux_arch

    found = iter(perf_to_kprobe_events(texts, symbols, vmlinux_arch(symbols)))
    out = []
    for text in args.events:
        if is_kernel_perf(text):
            text = next(found)
            if not args.quiet:  # as `perf probe -v` says what it writes to kprobe_events
                print(f"qprobe: writing event: {text}", file=sys.stderr, flush=True)
        out.append(text)
    args.events = out


def _check_symbols(args: argparse.Namespace, events: list[ProbeEvent]) -> None:
    """Each event's function checked in vmlinux before a VM boots: a typo gets the closest names."""
    from qprobe.events.funcs import check_probe_symbol

    named = [ev for ev in events if ev.symbol is not None]
    prob = _host_probeability(args) if named else None
    if prob is None:
        return
    # At boot every probe starts on a stub breakpoint: what --anywhere accepts (a probe the int3 path refuses
    # stays one once booted).
    prob.anywhere = getattr(args, "anywhere", False) or getattr(args, "boot", False)
    prob.symbols.init_text = getattr(args, "boot", False)  # __init functions run during the boot
    for ev in named:
        try:
            check_probe_symbol(prob, ev.symbol or "", ev.offset)
        except QprobeError as exc:
            raise QprobeError(f"{ev.text.strip()}: {exc}") from None


def _parse_definitions(
    args: argparse.Namespace,
) -> tuple[list[str | Definition | ProbeEvent], list[ProbeEvent | UprobeEvent]]:
    """args.events parsed in the language of the kernel that will run them, if the host knows it: what goes
    down to the target, and the definitions as parsed here, for the options' checks (the front end's
    parse_definitions, a missing BTF said as such).

    --boot's are parsed even where the host knows no language: each is refused if it is a uprobe (a uprobe's
    file is the guest's, read once the guest is up), from that one parse.
    """
    from qprobe.fetch import Definition, parse_definition
    from qprobe.frontend import parse_definitions
    from qprobe.kernel.usyntax import is_user_form

    boot = getattr(args, "boot", False)
    language = _host_language(args) if args.events else None
    out: list[str | Definition | ProbeEvent]
    checked: list[ProbeEvent | UprobeEvent] = []
    if language is not None:
        out, checked = parse_definitions(args.events, language[0], language[1], lambda exc: _without_btf(args, exc))
    elif boot:
        out = [text if is_user_form(text) else parse_definition(text) for text in args.events]
    else:
        return list(args.events), []
    if boot:
        for d in out:
            if isinstance(d, str) or (isinstance(d, Definition) and d.is_uprobe):
                text = d if isinstance(d, str) else d.text
                raise QprobeError(f"{text.strip()}: --boot arms kernel probes before the kernel runs; a uprobe's "
                                  "file is the guest's, read once the guest is up: add it then")  # fmt: skip
    return out, checked


def _check_boot(args: argparse.Namespace) -> None:
    """--boot's EVENTs are the kernel's (a uprobe's file is the guest's, read once the guest is up), armed
    through qprobe's own gdbstub client; a uprobe among them is refused as it is parsed (_parse_definitions)."""

    if (args.kernel_image is not None or args.kernel_cmdline is not None) and not (
        args.boot and args.attach is not None
    ):
        raise QprobeError("--kernel-image and --kernel-cmdline describe the boot of a QEMU started with -S: "
                          "only with --boot --attach")  # fmt: skip
    if not args.boot:
        return
    if getattr(args, "transport", "rsp") == "gdb":
        raise QprobeError("--boot stops the kernel at its first instructions through qprobe's own gdbstub client: "
                          "not with --transport gdb")  # fmt: skip


def _user_forms(target: Target, definitions: list[str | Definition | ProbeEvent],
                quiet: bool) -> list[str | Definition | ProbeEvent]:  # fmt: skip
    """perf's ``-x`` and bpftrace's ``uprobe:`` forms as the uprobe_events lines they make, their symbols
    resolved in the guest's files, each shown as ``perf probe -v`` shows what it writes."""
    from qprobe.frontend import resolve_user_forms

    def show(line: str) -> None:
        if not quiet:
            print(f"qprobe: writing event: {line}", file=sys.stderr, flush=True)

    return resolve_user_forms(definitions, target.resolve_user_symbol, target.arch.registers, show)


def _arm(target: Target, definition: str | Definition | ProbeEvent, callback: Callable[[EventHit], None] | None = None,
         flt: str | None = None, anywhere: bool = False) -> list[TraceEvent]:  # fmt: skip
    """One definition's events: one, or one per function its glob matches (the refused ones said on stderr).

    A definition parsed before boot goes down as its ProbeEvent (or Definition), checked there, not parsed
    again; text is parsed here, once.
    """
    from qprobe.events.define import definition_of, is_wildcard
    from qprobe.fetch import ProbeEvent

    if not isinstance(definition, ProbeEvent):
        definition = definition_of(definition)
    if not is_wildcard(definition):
        return [target.add_event(definition, callback, flt, anywhere)]
    found = target.add_events(definition, callback, flt, anywhere)
    refused = "".join(f"\n  {name}: {why}" for name, why in found.refused.items())
    print(f"qprobe: {found.pattern}: {len(found.events)} probes, {len(found.refused)} refused{refused}",
          file=sys.stderr, flush=True)  # fmt: skip
    return found.events
