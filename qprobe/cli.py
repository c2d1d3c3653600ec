"""The ``qprobe`` command: a thin layer over the Python API.

Every ``QprobeError`` is printed as one line and the exit status is non-zero;
tracebacks are only for bugs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from qprobe import __version__
from qprobe.errors import FetchArgError, QprobeError, TargetGone

if TYPE_CHECKING:
    from qprobe.api import Target
    from qprobe.events import EventHit, TraceEvent
    from qprobe.events.funcs import Probeability
    from qprobe.fetch import ProbeEvent, UprobeEvent
    from qprobe.fetch.dialect import Dialect
    from qprobe.kernel.symbols import Symbols
    from qprobe.proctree import ProcessTree
    from qprobe.shell.collect import Aggregation
    from qprobe.shell.printf import HitFormat


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, like every other qprobe error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"qprobe: error: {message} (see {self.prog} --help)\n")


def _number(kind: type[int] | type[float], lo: float, hi: float) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not lo <= value <= hi:
            bounds = f"{int(lo)}..{int(hi)}" if kind is int else f"{lo:g}..{hi:g}"
            raise argparse.ArgumentTypeError(f"{text} is outside {bounds}")
        return value

    return parse


# qprobe bench's parts: the probe-cost matrix, trace lines through the record rings, scale, the GDB rows
BENCH_SECTIONS = ("probes", "trace", "scale", "gdb")


def _sections(text: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in parts if p not in BENCH_SECTIONS]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"{text!r}: sections are {', '.join(BENCH_SECTIONS)}")
    return parts


def _memory(text: str) -> str:
    from qprobe.vmm.qemu import parse_memory

    try:
        size = parse_memory(text)
    except QprobeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not 128 << 20 <= size <= 64 << 30:
        raise argparse.ArgumentTypeError(f"{text} is outside 128M..64G")
    return text


def _files(specs: list[str]) -> dict[str, str]:
    out = {}
    for spec in specs:
        host, sep, guest = spec.rpartition(":")
        if not sep or not host or not guest.startswith("/"):
            raise QprobeError(f"bad --file {spec!r}: expected HOST_PATH:/GUEST/PATH")
        if not os.path.isfile(host) or not os.access(host, os.R_OK):
            raise QprobeError(f"bad --file {spec!r}: {host} is not a readable file")
        out[guest] = host
    return out


def _check_image(args: argparse.Namespace) -> None:
    """An unknown image is refused before anything is fetched or booted."""
    from qprobe.images.manifest import load_specs

    if getattr(args, "attach", None) is None and args.image not in load_specs():
        raise QprobeError(f"unknown image {args.image!r}; see `qprobe images`")


def _host_symbols(args: argparse.Namespace) -> Symbols | None:
    """The vmlinux on the host, without booting; None if it is not known here.

    A VM to attach to has its vmlinux named by ``--vmlinux``, or by the session file a VM that
    ``qprobe boot`` started keeps beside its gdbstub (else it is found once attached).
    """
    from qprobe.images import get_image

    vmlinux = getattr(args, "vmlinux", None)
    if vmlinux:
        return _load_symbols(str(vmlinux), None)
    if getattr(args, "attach", None) is not None:
        from qprobe.session import read_session
        from qprobe.vmm.connection import parse_address

        where = parse_address(args.attach)
        session = read_session(Path(where)) if isinstance(where, str) and Path(where).exists() else None
        return _load_symbols(str(session["vmlinux"]), None) if session is not None else None
    _check_image(args)
    _files(getattr(args, "file", []))  # every other input is checked before the image is fetched
    img = get_image(args.image)
    return _load_symbols(str(img.vmlinux), img.system_map)


@functools.lru_cache(maxsize=2)
def _loaded(vmlinux: str, system_map: Path | None, mtime_ns: int) -> Symbols:
    from qprobe.kernel.symbols import Symbols

    return Symbols.load(vmlinux, system_map)


def _load_symbols(vmlinux: str, system_map: Path | None) -> Symbols:
    """A vmlinux's symbols, read once for every check of one command (each read takes 0.2 s)."""
    try:
        mtime = os.stat(vmlinux).st_mtime_ns
    except OSError:
        mtime = 0  # Symbols.load says what is wrong with it
    return _loaded(vmlinux, system_map, mtime)


def _host_dialect(args: argparse.Namespace) -> Dialect | None:
    """The kprobe_events language of the vmlinux on the host; None if it is not known here.

    Without it (a VM to attach to, no --vmlinux) definitions are checked once attached,
    in the running kernel's language, not before in another one's.
    """
    from qprobe.api import vmlinux_arch
    from qprobe.kernel.features import init_stack_span
    from qprobe.kernel.tracefs import probe_dialect

    symbols = _host_symbols(args)
    if symbols is None:
        return None
    return probe_dialect(symbols, vmlinux_arch(symbols).registers.pt_regs, init_stack_span(symbols))


def _host_probeability(args: argparse.Namespace) -> Probeability | None:
    """The kernel's probe refusals from the vmlinux on the host, without booting; None if it is not known here."""
    from qprobe.api import vmlinux_arch
    from qprobe.events.funcs import Probeability

    symbols = _host_symbols(args)
    return None if symbols is None else Probeability.of(symbols, vmlinux_arch(symbols))


def _perf_definitions(args: argparse.Namespace) -> None:
    """``perf ...`` EVENTs (perf probe's language) become the kprobe_events lines perf would write, shown.

    They are resolved from vmlinux's DWARF on the host, before anything boots.
    """
    from qprobe.kernel.perfprobe import perf_to_kprobe

    texts = [t for t in args.events if _is_kernel_perf(t)]
    if not texts:
        return
    symbols = _host_symbols(args)
    if symbols is None:
        raise QprobeError("a perf definition is resolved from vmlinux's debug information: give --vmlinux")
    from qprobe.api import vmlinux_arch
    from qprobe.events.funcs import Probeability, unknown_symbol
    from qprobe.kernel.perfprobe import parse_perf_probe

    for text in texts:  # a typo gets the closest names, as a kprobe_events definition's does
        name = parse_perf_probe(text).function
        if name is not None and name not in symbols:
            raise unknown_symbol(symbols, name, Probeability.of(symbols, vmlinux_arch(symbols)).functions())
    found = iter(perf_to_kprobe(texts, symbols, vmlinux_arch(symbols)))
    out = []
    for text in args.events:
        if _is_kernel_perf(text):
            text = next(found).definition
            if not args.quiet:  # as `perf probe -v` says what it writes to kprobe_events
                print(f"qprobe: writing event: {text}", file=sys.stderr, flush=True)
        out.append(text)
    args.events = out


def _is_kernel_perf(text: str) -> bool:
    """A perf probe definition of the kernel's (``perf -x PATH`` is a program's: a uprobe)."""
    from qprobe.kernel.perfprobe import is_perf_definition
    from qprobe.kernel.usyntax import is_user_form

    return is_perf_definition(text) and not is_user_form(text)


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


def _arm(target: Target, definition: str | ProbeEvent, callback: Callable[[EventHit], None] | None = None,
         flt: str | None = None, anywhere: bool = False) -> list[TraceEvent]:  # fmt: skip
    """One definition's events: one, or one per function its glob matches (the refused ones said on stderr).

    A definition parsed before boot goes down as its ProbeEvent, checked there, not parsed again.
    """
    from qprobe.events.define import is_wildcard

    if not is_wildcard(definition):
        return [target.add_event(definition, callback, flt, anywhere)]
    found = target.add_events(definition, callback, flt, anywhere)
    refused = "".join(f"\n  {name}: {why}" for name, why in found.refused.items())
    print(f"qprobe: {found.pattern}: {len(found.events)} probes, {len(found.refused)} refused{refused}",
          file=sys.stderr, flush=True)  # fmt: skip
    return found.events


def _boot(args: argparse.Namespace, at_boot: Callable[[Target], None] | None = None) -> Target:
    """The target: attached, or booted (``at_boot``: armed before the kernel's first instruction)."""
    import qprobe

    transport = getattr(args, "transport", "rsp")
    if getattr(args, "attach", None) is not None:  # an empty --attach is an error, not a reason to boot
        if getattr(args, "cmdline", ""):
            raise QprobeError("--cmdline adds to the command line of a VM qprobe boots: with --boot --attach, "
                              "--kernel-cmdline gives the whole one QEMU boots the kernel with")  # fmt: skip
        return qprobe.attach(args.attach, args.vmlinux, allow_remote=args.allow_remote, transport=transport,
                             console=getattr(args, "console", None), shell=getattr(args, "shell", None),
                             at_boot=at_boot,
                             kernel_image=getattr(args, "kernel_image", None),
                             kernel_cmdline=getattr(args, "kernel_cmdline", None))  # fmt: skip
    _check_image(args)
    return qprobe.boot(args.image, smp=args.smp, memory=args.memory, files=_files(args.file), transport=transport,
                       cmdline=getattr(args, "cmdline", ""), at_boot=at_boot,
                       tcg_thread=getattr(args, "tcg_thread", ""))  # fmt: skip


def cmd_boot(args: argparse.Namespace) -> int:
    if args.detach:
        return _boot_detached(args)
    target = _boot(args)
    qemu = target.qemu
    assert qemu is not None
    for line in _booted(args, target):
        print(line)
    print("Ctrl-C stops the VM.", flush=True)
    try:
        while qemu.alive():
            time.sleep(0.5)
        print("QEMU exited", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        qemu.terminate()


def _booted(args: argparse.Namespace, target: Target) -> list[str]:
    """What a booted VM's user needs: the kernel, how to attach, where its console goes."""
    qemu = target.qemu
    assert qemu is not None
    lines = [f"booted {args.image} in {target.timings.get('boot', 0):.1f} s "
             f"(kernel slide {target.slide:#x}, {target.vcpus} vCPUs)",
             f"attach with:  qprobe attach unix:{qemu.gdb_path}",
             f"console log:  {qemu.console_log}",
             f"shell log:    {qemu.shell_log}"]  # fmt: skip
    # Release the gdbstub and the serial ports (each takes one client) so other qprobe processes can attach.
    target.machine.close(detach=True)
    target.release_serial_ports()
    return lines


def _boot_detached(args: argparse.Namespace) -> int:
    """Boot in a child process that keeps the VM (it dies with its owner) and return once it is ready.

    The child is forked before anything boots, in its own session, so the terminal's
    Ctrl-C and hang-up do not reach it; it reports through a pipe and then only waits.
    """
    _check_image(args)
    _files(args.file)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write_end)
        with os.fdopen(read_end) as report:
            text = report.read()
        sys.stdout.write(text)
        if not text.startswith("booted "):
            os.waitpid(pid, 0)
            return 2
        print(f"the VM runs in the background; stop it with:  kill {pid}", flush=True)
        return 0
    os.close(read_end)
    os.setsid()
    status = 0
    with os.fdopen(write_end, "w") as report:
        try:
            target = _boot(args)
        except QprobeError as exc:
            report.write(f"qprobe: error: {exc}\n")
            os._exit(2)
        report.write("".join(line + "\n" for line in _booted(args, target)))
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    qemu = target.qemu
    assert qemu is not None
    try:
        while qemu.alive():
            time.sleep(0.5)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        qemu.terminate()
    os._exit(status)


def cmd_attach(args: argparse.Namespace) -> int:
    """Attach, restore anything an earlier qprobe left behind, report, detach."""
    target = _boot(args)
    try:
        print(f"attached: kernel slide {target.slide:#x}, {target.vcpus} vCPUs, "
              f"restored {target.recovered} leftover patch(es)")  # fmt: skip
    finally:
        target.close()
    return 0


class _Trace:
    """One ``qprobe trace``'s output: what the options ask for, checked before boot, and what was shown."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.lock = threading.Lock()  # one line (or map) at a time on stdout
        self.shown: collections.Counter[str] = collections.Counter()  # with --run, the command's hits
        self.tree: ProcessTree | None = None  # with --run, the command's processes once followed
        # Guest text (a process name, a fetched string) reaches a terminal with its control characters shown;
        # the user's own --format keeps its escapes (a colour, say).
        self.tty = sys.stdout.isatty()
        self.fmt: HitFormat | None = None
        if args.format is not None:
            from qprobe.shell.printf import parse_printf

            if args.json:
                raise QprobeError("--format and --json: choose one")
            self.fmt = parse_printf(args.format)
        self.agg: Aggregation | None = None
        self.every: float | None = None
        if args.map is not None:
            from qprobe.shell.collect import parse_map

            if args.json or args.format is not None:
                raise QprobeError("--map prints a map instead of lines: not with --json or --format")
            self.agg, self.every = parse_map(args.map)
        self.cpid_filter = args.filter is not None and "$cpid" in args.filter
        if self.cpid_filter and not args.run:
            raise QprobeError("$cpid is the pid of --run's command: give --run CMD")
        if getattr(args, "boot", False) and (args.map is not None or self.cpid_filter):
            raise QprobeError("--boot traces from the kernel's first instruction on: not with --map or $cpid")
        _check_boot(args)
        # The filter as it is checked before boot; one naming $cpid is set on the events once the command forks.
        self.filter: str | None = args.filter.replace("$cpid", "0") if self.cpid_filter else args.filter

    def check(self, ev: ProbeEvent | UprobeEvent) -> None:
        """A definition against the filter and --format, before booting."""
        from qprobe.events import event_filter

        if self.filter:
            event_filter(ev, self.filter)
        if self.fmt is not None:
            missing = [n for n in self.fmt.names() if n not in {a.name for a in ev.args}]
            if missing:
                raise QprobeError(f"--format names {missing[0]!r}, which {ev.text!r} does not fetch")
            self.fmt.check_types(ev.integer_args)

    def show(self, hit: EventHit) -> None:
        """One hit's line: with --run only the command's (those before its process tree is followed, the
        guest shell reading the line that asks for its pid, are not); with --boot every hit, the boot's first."""
        if self.args.run and not getattr(self.args, "boot", False) and (self.tree is None or not self.tree.owns(hit)):
            return
        with self.lock:
            self.shown[hit.event] += 1
            if self.fmt is not None:
                sys.stdout.write(self.fmt(hit.escaped() if self.tty else hit))
                sys.stdout.flush()
            elif self.args.json:
                print(json.dumps(hit.as_json()), flush=True)
            else:
                print((hit.escaped() if self.tty else hit).line(), flush=True)

    def owns(self, hit: EventHit) -> bool:
        """With --run, whether the map takes ``hit``: the command's hits only."""
        if self.tree is None or not self.tree.owns(hit):
            return False
        with self.lock:
            self.shown[hit.event] += 1
        return True

    def write(self, text: str) -> None:
        with self.lock:
            sys.stdout.write(text)
            sys.stdout.flush()


def cmd_trace(args: argparse.Namespace) -> int:
    """Arm kprobe_events definitions, print one line per hit, then a summary.

    With ``--run CMD`` only the hits of CMD's processes are printed (bpftrace's ``-c``),
    ``$cpid`` in the filter is CMD's pid, and CMD's exit status is qprobe's.
    """
    _perf_definitions(args)
    if args.run:  # the command's hits are told by their task's pid, read at the offset the kernel's types give
        _need_dwarf(args, "--run (which keeps the hits of the command's processes)")
    trace = _Trace(args)
    definitions = _check_definitions(args, trace)
    _say_booting(args)
    at_boot: list[TraceEvent] = []

    def arm_at_boot(target: Target) -> None:  # before the kernel's first instruction: stub breakpoints
        at_boot.extend(_arm_traced(target, definitions, trace))  # the int3 path once booted, unless --anywhere

    with _boot(args, arm_at_boot if args.boot else None) as target:
        if args.lossy:
            target.records_lossy = True
        events = at_boot if args.boot else _arm_traced(target, definitions, trace)
        status = 0
        try:
            status = _collect(target, events, trace)
        finally:
            _summarize(target, events, trace)
    return status


def _check_definitions(args: argparse.Namespace, trace: _Trace) -> list[str | ProbeEvent]:
    """Each definition parsed once, before booting where the kernel's vmlinux is at hand: syntax errors
    (events, filter, --format, --map's names) and unknown functions come before a VM does.

    Returns what goes down to the target: each definition's ProbeEvent, or its text where there is
    none yet (a VM to attach to whose vmlinux is not given: parsed in the running kernel's language;
    a uprobe's, whose file is the guest's).
    """
    from qprobe.fetch import ProbeEvent

    definitions, checked = _parse_definitions(args)
    for ev in checked:
        trace.check(ev)
    if trace.agg is not None:
        from qprobe.shell.collect import check_map_names

        check_map_names(trace.agg, checked)
        if "$stack" in trace.agg.keys:
            _need_dwarf(args, "--map's $stack (a kernel stack trace)")
    _check_symbols(args, [ev for ev in checked if isinstance(ev, ProbeEvent)])
    return definitions


def _parse_definitions(args: argparse.Namespace) -> tuple[list[str | ProbeEvent], list[ProbeEvent | UprobeEvent]]:
    """args.events parsed in the language of the kernel that will run them, if the host knows it: what goes
    down to the target, and the definitions as parsed here, for the options' checks.

    A uprobe's definition (its probe point a guest path, or perf's ``-x`` and bpftrace's ``uprobe:`` forms)
    goes down as text: its file and symbols are the guest's, so the kernel's checks of them come once booted;
    the rest of its line is judged here, a symbol standing in as offset 0.
    """
    from qprobe.events.define import is_uprobe
    from qprobe.fetch import ProbeEvent, UprobeEvent, parse_event, parse_uprobe_event
    from qprobe.kernel.usyntax import is_user_form, symbolic_user_form, unresolved_syntax

    dialect = _host_dialect(args) if args.events else None
    if dialect is None:
        return list(args.events), []
    out: list[str | ProbeEvent] = []
    checked: list[ProbeEvent | UprobeEvent] = []
    for text in args.events:
        line = symbolic_user_form(text) if is_user_form(text) else text
        if is_uprobe(line):
            try:
                uev = parse_uprobe_event(unresolved_syntax(line), dialect)
            except FetchArgError as exc:
                raise FetchArgError(exc.reason, line, exc.column, logged=exc.logged, detail=exc.detail) from None
            if isinstance(uev, UprobeEvent):
                checked.append(uev)
            out.append(text)
            continue
        try:
            ev = parse_event(text, dialect=dialect)
        except FetchArgError as exc:
            raise _without_btf(args, exc) from None
        if isinstance(ev, ProbeEvent):
            checked.append(ev)
        out.append(ev if isinstance(ev, ProbeEvent) else text)  # a deletion is refused once armed, as the API does
    return out, checked


def _need_dwarf(args: argparse.Namespace, what: str) -> None:
    """A feature that reads the kernel's DWARF refused before boot, in one line, where vmlinux has none."""
    from qprobe.kernel.debuginfo import need_dwarf

    symbols = _host_symbols(args)
    if symbols is not None:
        need_dwarf(symbols.path, what)


def _without_btf(args: argparse.Namespace, exc: FetchArgError) -> FetchArgError:
    """The kernel's refusal of a named (BTF) argument, with why where the vmlinux has no BTF."""
    from qprobe.fetch.messages import NOSUP_BTFARG
    from qprobe.kernel.debuginfo import BTF_FRAGMENT, has_btf_section

    symbols = _host_symbols(args)
    if exc.reason != NOSUP_BTFARG or symbols is None or has_btf_section(symbols.path):
        return exc
    why = f"{symbols.path.name} has no BTF: named arguments need a kernel built with {BTF_FRAGMENT}"
    return FetchArgError(exc.reason, exc.text, exc.column, logged=exc.logged, detail=why)


def _user_forms(target: Target, definitions: list[str | ProbeEvent], quiet: bool) -> list[str | ProbeEvent]:
    """perf's ``-x`` and bpftrace's ``uprobe:`` forms as the uprobe_events lines they make, their symbols
    resolved in the guest's files, each shown as ``perf probe -v`` shows what it writes."""
    from qprobe.kernel.usyntax import is_user_form, user_form_definition

    out: list[str | ProbeEvent] = []
    for d in definitions:
        if isinstance(d, str) and is_user_form(d):
            d = user_form_definition(d, target.resolve_user_symbol)
            if not quiet:
                print(f"qprobe: writing event: {d}", file=sys.stderr, flush=True)
        out.append(d)
    return out


def _arm_traced(target: Target, definitions: list[str | ProbeEvent], trace: _Trace,
                anywhere: bool | None = None) -> list[TraceEvent]:  # fmt: skip
    """Every definition's events, their hits printed in the guest's order of hits (or folded into the map);
    ``anywhere`` (else --anywhere) arms them with stub breakpoints."""

    def in_order(hit: EventHit) -> None:  # whatever path a hit took, the timeline hands it on in order
        target.timeline.push(hit.order, lambda: trace.show(hit))

    lines = in_order if trace.agg is None else None
    flt = None if trace.cpid_filter else trace.filter
    definitions = _user_forms(target, definitions, trace.args.quiet)
    anywhere = trace.args.anywhere if anywhere is None else anywhere
    return [te for d in definitions for te in _arm(target, d, lines, flt, anywhere)]


def _collect(target: Target, events: list[TraceEvent], trace: _Trace) -> int:
    """Hits while the trace runs (until --run's command ends, --duration, or Ctrl-C); then the probes go.

    Returns the exit status: --run's command's, 130 for a Ctrl-C, else 0.
    """
    agg, printed = trace.agg, threading.Event()  # set when the map's interval printing ends
    collector = None
    if agg is not None:
        from qprobe.shell.collect import Collector

        collector = Collector(events, agg, every=trace.every, owns=trace.owns if trace.args.run else None)
        if trace.every is not None:

            def print_every(seconds: float) -> None:  # bpftrace's interval probe: print(@); clear(@)
                while not printed.wait(seconds):
                    agg.print_and_clear(trace.write)

            threading.Thread(target=print_every, args=(trace.every,), name="qprobe-map", daemon=True).start()
    status = 0
    try:
        with collector if collector is not None else contextlib.nullcontext():
            try:
                status = _run_traced(target, events, trace)
            finally:
                printed.set()  # the interval printing ends before the map's last fold
    except KeyboardInterrupt:
        status = 130
    finally:
        try:
            target.remove_events(events)
        except TargetGone:
            pass  # a VM that is gone holds no probes; the summary still says what was seen, then the error
        if agg is not None:
            agg.print_and_clear(trace.write)
    return status


def _run_traced(target: Target, events: list[TraceEvent], trace: _Trace) -> int:
    """Wait while the events trace: --run's command (its exit status returned), --duration, or until Ctrl-C."""
    args = trace.args
    if args.run:
        from qprobe.proctree import ProcessTree

        def on_root(cpid: int) -> None:  # the filter's $cpid, once the command has forked
            if trace.cpid_filter:
                from qprobe.events import event_filter

                for te in events:
                    te.filter = event_filter(te.definition, args.filter.replace("$cpid", str(cpid)))

        trace.tree = tree = ProcessTree(target, on_root)
        if not args.quiet:
            print(f"qprobe: tracing {len(events)} event(s) while {args.run!r} runs", file=sys.stderr, flush=True)
        try:
            result = target.run(args.run, timeout=args.timeout)
        finally:
            tree.close()
        if result.output:
            from qprobe.fetch import terminal_safe

            out = result.output.removesuffix("\n") + "\n"
            sys.stderr.write(terminal_safe(out) if sys.stderr.isatty() else out)
        return result.status  # the command's own, as bpftrace -c passes it through
    if args.duration:
        target.wait(args.duration)
    else:
        print(f"qprobe: tracing {len(events)} event(s); Ctrl-C to stop", file=sys.stderr, flush=True)
        target.wait()
    return 0


def _summarize(target: Target, events: list[TraceEvent], trace: _Trace) -> None:
    """One row an event (its trace shows one event name), the counts of probes appended to it added in."""
    args = trace.args
    totals: dict[str, collections.Counter[str]] = {}
    for te in events:
        totals.setdefault(te.definition.event, collections.Counter()).update(
            hits=te.nhit, nmissed=te.nmissed, lost=te.lost, filtered=te.filtered)  # fmt: skip
    summary: dict[str, dict[str, int]] = {}
    for name, t in totals.items():
        row = {"hits": t["hits"], "nmissed": t["nmissed"], "lost": t["lost"]}
        if trace.tree is not None:  # hits counts the command's; the other processes' are said apart
            row.update(hits=trace.shown[name], others=t["hits"] - trace.shown[name])
        if args.filter:
            row["filtered"] = t["filtered"]
        summary[name] = row
    waited = target.record_waits() if target.machine.alive else 0
    with trace.lock:
        if args.json:
            rings = {"records": {"waited": waited}} if waited else {}
            print(json.dumps({"summary": summary, **rings}), flush=True)
        else:
            for name, row in summary.items():
                print(f"# {name}: " + " ".join(f"{k}={v}" for k, v in row.items()))
            if waited:
                # Nothing was lost for it: these hits' vCPUs waited for qprobe to drain a full ring.
                print(f"# records: waited={waited}")


def _check_boot(args: argparse.Namespace) -> None:
    """--boot's EVENTs are the kernel's (a uprobe's file is the guest's, read once the guest is up), armed
    through qprobe's own gdbstub client."""
    from qprobe.events.define import is_uprobe
    from qprobe.kernel.usyntax import is_user_form

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
    for text in args.events:
        if is_uprobe(text) or is_user_form(text):
            raise QprobeError(f"{text.strip()}: --boot arms kernel probes before the kernel runs; a uprobe's file is "
                              "the guest's, read once the guest is up: add it then")  # fmt: skip


def _say_booting(args: argparse.Namespace) -> None:
    """Said before the few seconds a boot takes, as the shell does, so that a quiet terminal is not a hung one."""
    if getattr(args, "attach", None) is None and not args.quiet:
        print(f"qprobe: booting {args.image} ({args.smp} vCPUs)...", file=sys.stderr, flush=True)


def cmd_list(args: argparse.Namespace) -> int:
    """Arm the given events (if any) and print the probe list as debugfs's kprobes/list does, with reasons."""
    from qprobe.fetch import ProbeEvent
    from qprobe.kernel.usyntax import is_user_form
    from qprobe.shell.parse import is_definition

    _perf_definitions(args)
    for text in args.events:
        # `qprobe list 'vfs_*'`, as bpftrace -l and perf probe -F list functions
        if not is_definition(text) and not is_user_form(text):
            raise QprobeError(f"list arms EVENT definitions and lists the probes; to find functions: "
                              f"qprobe funcs {text!r}")  # fmt: skip
    definitions, checked = _parse_definitions(args)
    _check_symbols(args, [ev for ev in checked if isinstance(ev, ProbeEvent)])
    _say_booting(args)
    with _boot(args) as target:
        definitions = _user_forms(target, definitions, args.quiet)
        events = [te for d in definitions for te in _arm(target, d, anywhere=args.anywhere)]
        try:
            listing = target.list_probes()
        finally:
            target.remove_events(events)
    if not listing:
        # debugfs's list is empty then; a user who typed `qprobe list` wants to know why nothing came.
        print("qprobe: no probes are armed (list shows the EVENTs given to it: qprobe list 'p:rd vfs_read')",
              file=sys.stderr)  # fmt: skip
    print(listing, end="")
    return 0


def cmd_funcs(args: argparse.Namespace) -> int:
    """The kernel's functions matching GLOBs, each with whether qprobe can probe it, from vmlinux alone."""
    from qprobe.events.funcs import render_funcs

    if args.x is not None:
        return _user_funcs(args)
    prob = _host_probeability(args)
    if prob is None:  # --attach without --vmlinux: the attached VM's own file
        with _boot(args) as target:
            from qprobe.events.funcs import Probeability

            return _print_funcs(render_funcs(Probeability.of_target(target), args.globs))
    return _print_funcs(render_funcs(prob, args.globs))


def _user_funcs(args: argparse.Namespace) -> int:
    """``funcs -x PATH``: the functions of a guest program or library, from its ELF in the guest's page cache."""
    from qprobe.kernel.usyntax import render_user_funcs

    path = args.x
    if not path.startswith("/"):
        raise QprobeError(f"-x {path!r}: give the file's absolute path in the guest")
    _say_booting(args)
    with _boot(args) as target:
        elf = target.user_elf(path)
        return _print_funcs(render_user_funcs(elf, path, args.globs))


def _print_funcs(result: tuple[str, str, int]) -> int:
    text, summary, found = result
    sys.stdout.write(text)
    sys.stdout.flush()
    print(summary, file=sys.stderr)
    return 0 if found else 1


def cmd_images(args: argparse.Namespace) -> int:
    from qprobe.images import get_image, list_images

    if getattr(args, "images_command", None) == "add":
        from qprobe.images.useradd import add_buildroot_image

        manifest, found = add_buildroot_image(args.name, Path(args.buildroot), args.description)
        print(f"added image {args.name} to {manifest}:{found}")
        return 0
    if args.fetch:
        for name in args.fetch:
            img = get_image(name)
            print(f"{name}: ready ({img.kernel_version}, preempt={img.preempt})")
        return 0
    for info in list_images():
        print(f"{info.name:20} {info.state:12} {info.description}")
    return 0


def cmd_blacklist(args: argparse.Namespace) -> int:
    with _boot(args) as target:
        for line in target.blacklist():
            print(line)
    return 0


def cmd_shell(args: argparse.Namespace) -> int:
    """The interactive shell on a booted (or attached) target; every probe is removed on the way out.

    EVENTs are checked before anything boots.  With ``--boot`` they are armed before the kernel's first
    instruction (stub breakpoints, as ``trace --boot``), so that the prompt finds them as events of the
    shell, their hits since start_kernel counted; without it they are the shell's first commands.
    """
    from qprobe.fetch import ProbeEvent
    from qprobe.shell import Shell, run_shell

    if args.boot and not args.events:
        raise QprobeError("--boot arms the EVENTs given after it before the kernel runs: give at least one, "
                          "e.g. 'p:sk start_kernel'")  # fmt: skip
    _check_image(args)
    _check_boot(args)
    _perf_definitions(args)
    definitions, checked = _parse_definitions(args)
    _check_symbols(args, [ev for ev in checked if isinstance(ev, ProbeEvent)])
    _say_booting(args)
    at_boot: list[TraceEvent] = []
    armed_at: list[float] = []

    def arm_at_boot(target: Target) -> None:  # before the kernel's first instruction: stub breakpoints
        at_boot.extend(te for d in definitions for te in _arm(target, d))  # the int3 path once booted
        armed_at.append(time.monotonic())

    with _boot(args, arm_at_boot if args.boot else None) as target:
        shell = Shell(target)
        for te in at_boot:
            shell.armed[te.name] = armed_at[0]  # stats' hits/s since the events were armed, not since the prompt
        if not args.boot:
            for text in args.events:
                shell.execute(text)
        return run_shell(target, shell)


def cmd_drgn(args: argparse.Namespace) -> int:
    """drgn's interactive mode on a booted (or attached) guest, EVENTs armed while it runs."""
    from qprobe.shell.inspect_cmds import drgn_session

    _check_image(args)
    _need_dwarf(args, "qprobe drgn (the kernel's types and variables)")
    _say_booting(args)
    with _boot(args) as target:
        for definition in args.events:
            target.add_event(definition)
        drgn_session(target)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from qprobe.demo import run_demo

    return run_demo(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from qprobe.bench import run_bench

    return run_bench(args)


def _target_options(p: argparse.ArgumentParser, attach: bool = True) -> None:
    p.add_argument("--image", default="debian-cloud", help="image to boot (see `qprobe images`)")
    p.add_argument("--smp", type=_number(int, 1, 64), default=2, help="number of vCPUs (default 2)")
    p.add_argument("--memory", type=_memory, default="512M", help="guest RAM (default 512M)")
    p.add_argument("--file", action="append", default=[], metavar="HOST:GUEST",
                   help="add a host file to the guest's root filesystem (repeatable)")  # fmt: skip
    p.add_argument("--transport", choices=("rsp", "gdb"), default="rsp",
                   help="qprobe's own gdbstub client (fast, default) or a real gdb through GDB/MI")  # fmt: skip
    p.add_argument("--tcg-thread", choices=("single", "multi"), default="",
                   help="TCG's thread mode for the VM it boots: every vCPU on one host thread, or one each "
                   "(QEMU's default; see docs/reliability.md)")  # fmt: skip
    if attach:
        p.add_argument("--attach", metavar="ADDR", help="attach to a running QEMU instead of booting")
        p.add_argument("--vmlinux", help="the running kernel's vmlinux (for --attach)")
        p.add_argument("--allow-remote", action="store_true", help="allow attaching to a non-local address")
        p.add_argument("--console", metavar="SOCK",
                       help="for --attach: the Unix socket of the guest's console (its kernel log, and its shell "
                       "without --shell)")  # fmt: skip
        p.add_argument("--shell", metavar="SOCK",
                       help="for --attach: the Unix socket of the serial port the guest's shell runs on")  # fmt: skip


def _attached_boot_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kernel-image", metavar="PATH",
                   help="with --boot --attach: the kernel image QEMU boots (its KASLR alignment), where its "
                   "command line has no -kernel to read it from")  # fmt: skip
    p.add_argument("--kernel-cmdline", metavar="ARGS",
                   help="with --boot --attach: the whole command line QEMU gives the kernel, where its command "
                   "line has no -append to read it from")  # fmt: skip


def _anywhere_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--anywhere", action="store_true",
                   help="arm the probes with QEMU's own breakpoints, writing nothing into the guest: also on the "
                   "kernel's blacklist (entry text, noinstr, the int3/NMI paths) and notrace functions; two VM "
                   "stops a hit (return probes too: the return caught where it lands)")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="qprobe", description="Linux kprobes from outside a QEMU guest.")
    parser.add_argument("--version", action="version", version=f"qprobe {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only errors")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("boot", help="boot an image and keep the VM running for `qprobe attach`")
    _target_options(p, attach=False)
    p.add_argument("--detach", action="store_true", help="return once the VM is ready; it runs in the background")
    p.set_defaults(func=cmd_boot)

    p = sub.add_parser("attach", help="attach to a running VM, restore leftovers of a crashed qprobe, detach")
    p.add_argument("attach", metavar="ADDR", help="unix:PATH of the gdbstub (printed by `qprobe boot`) or HOST:PORT")
    p.add_argument("--vmlinux", help="the running kernel's vmlinux (found automatically for `qprobe boot` VMs)")
    p.add_argument("--allow-remote", action="store_true", help="allow a non-local HOST:PORT")
    p.set_defaults(func=cmd_attach)

    p = sub.add_parser("trace", help="trace kprobe_events and uprobe_events definitions, one line per hit (ftrace)")
    _target_options(p)
    p.add_argument("--run", metavar="CMD", help="run CMD in the guest while tracing, then stop")
    p.add_argument("--boot", action="store_true",
                   help="arm the events before the kernel's first instruction (QEMU's breakpoints, the int3 path once "
                   "booted) and trace its boot from start_kernel on, __init functions too; then --run/--duration as "
                   "usual, every hit printed")  # fmt: skip
    p.add_argument(
        "--cmdline",
        default="",
        metavar="ARGS",
        help="more kernel command line for the VM it boots (e.g. initcall_debug); not with --attach",
    )
    _attached_boot_options(p)
    p.add_argument(
        "--duration", type=_number(float, 0.001, 1e7), metavar="S", help="trace for S seconds (default: until Ctrl-C)"
    )
    p.add_argument("--timeout", type=_number(float, 0.001, 1e7), default=600, help="limit for --run (default 600 s)")
    p.add_argument("--json", action="store_true", help="one JSON object per hit and a final summary object")
    _anywhere_option(p)
    p.add_argument("--lossy", action="store_true",
                   help="drop a hit's record when its CPU's ring is full and count it lost, as perf and bpftrace "
                   "do (default: the hitting vCPU waits for qprobe to drain the ring, so no line is lost)")  # fmt: skip
    p.add_argument("--format", metavar="PRINTF",
                   help="print each hit with bpftrace's printf arguments: '\"%%-16s %%d\\n\", $comm, count' "
                   "($comm $pid $cpu $event $func $ts $addr or argument names)")  # fmt: skip
    p.add_argument("--map", metavar="AGG",
                   help="instead of lines, one bpftrace map over every event, printed at the end (or every S): "
                   "'count by $comm', 'sum(count) by $comm, $pid', 'hist(count)', 'lhist(count, 0, 4096, 512)', "
                   "'count by $func every 1'; keys $comm $pid $cpu $func $event $stack or argument names")  # fmt: skip
    p.add_argument(
        "--filter",
        metavar="EXPR",
        help="ftrace event filter over the events' arguments and common_pid/comm/cpu, "
        "e.g. 'count >= 4096 && comm == \"cat\"'; rejected hits are only counted",
    )
    p.add_argument(
        "events",
        nargs="+",
        metavar="EVENT",
        help="kprobe_events syntax: 'p:myread vfs_read count=%%dx:u64', 'r:ret ksys_read ret=$retval'; "
        "or perf probe's after the word perf: 'perf vfs_read:23 ret file->f_pos', 'perf fs/read_write.c:473 ret'; "
        "a uprobe on a guest file: 'p:uq /bin/prog:func a=%%di' (uprobe_events syntax, PATH:SYMBOL or PATH:OFFSET), "
        "'perf -x /bin/prog func a=%%di', bpftrace's 'uprobe:/bin/prog:func arg0 comm' or "
        "'uretprobe:/bin/prog:func retval'",
    )
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser(
        "list",
        help="arm EVENTs and print the probe list (debugfs kprobes/list format, with why a probe is not optimized)",
    )
    _target_options(p)
    _anywhere_option(p)
    p.add_argument(
        "events",
        nargs="*",
        metavar="EVENT",
        help="kprobe_events definitions to arm first (or 'perf DEF' in perf probe's language)",
    )
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("funcs", help="kernel functions matching GLOBs and whether each can be probed (no boot); "
                       "-x PATH: a guest program's or library's functions (boots)")  # fmt: skip
    p.add_argument("-x", metavar="PATH",
                   help="list the functions of this guest program or library (its ELF symbols: file offset, size, "
                   "name, as PATH:SYMBOL and PATH:0xOFFSET probe them); the file is read from the guest, so this "
                   "boots the image (or uses --attach)")  # fmt: skip
    p.add_argument("--file", action="append", default=[], metavar="HOST:GUEST",
                   help="with -x: add a host file to the guest's root filesystem first (repeatable)")  # fmt: skip
    p.add_argument("--image", default="debian-cloud", help="whose vmlinux (see `qprobe images`)")
    p.add_argument("--attach", metavar="ADDR", help="a running VM's (its vmlinux, or --vmlinux's)")
    p.add_argument("--vmlinux", help="this vmlinux, not an image's")
    p.add_argument("--allow-remote", action="store_true", help="allow attaching to a non-local address")
    p.add_argument("globs", nargs="*", metavar="GLOB", help="shell patterns such as 'vfs_*' (default: every function)")
    p.set_defaults(func=cmd_funcs, transport="rsp", smp=2, memory="512M")

    p = sub.add_parser("images", help="list the known images, or fetch/build them")
    p.add_argument("--fetch", nargs="+", metavar="NAME", help="fetch and build these images")
    p.set_defaults(func=cmd_images)
    images_sub = p.add_subparsers(dest="images_command", metavar="add")
    add = images_sub.add_parser("add", help="add an image of yours to $QPROBE_IMAGES (~/.config/qprobe/images.toml)")
    add.add_argument("name", metavar="NAME", help="the image's name (--image NAME)")
    add.add_argument("--buildroot", required=True, metavar="PATH/output",
                     help="buildroot's output directory: images/bzImage, the rootfs, images/start-qemu.sh and "
                     "build/linux-*/vmlinux, .config and System.map are found there")  # fmt: skip
    add.add_argument("--description", default="", help="a line for `qprobe images`")

    p = sub.add_parser("blacklist", help="print the addresses qprobe refuses to probe")
    _target_options(p)
    p.set_defaults(func=cmd_blacklist)

    p = sub.add_parser("shell", help="an interactive shell: kprobe_events definitions, live hits, counts, histograms")
    _target_options(p)
    p.add_argument("--boot", action="store_true",
                   help="arm the EVENTs before the kernel's first instruction (QEMU's breakpoints, the int3 path once "
                   "booted): at the prompt they are events of the shell, with their hits since start_kernel "
                   "(stats, list, events; -:NAME removes one)")  # fmt: skip
    p.add_argument("--cmdline", default="", metavar="ARGS",
                   help="more kernel command line for the VM it boots (e.g. initcall_debug); not with "
                   "--attach")  # fmt: skip
    _attached_boot_options(p)
    p.add_argument("events", nargs="*", metavar="EVENT",
                   help="kprobe_events definitions (or 'perf DEF') to add before the prompt; with --boot, "
                   "before the kernel runs")  # fmt: skip
    p.set_defaults(func=cmd_shell)

    p = sub.add_parser("drgn", help="drgn's interactive mode on the live guest (`prog` bound, EVENTs armed)")
    _target_options(p)
    p.add_argument("events", nargs="*", metavar="EVENT", help="kprobe_events definitions to arm for the session")
    p.set_defaults(func=cmd_drgn)

    p = sub.add_parser("demo", help="boot the default image with demonstration probes (make run)")
    _target_options(p, attach=False)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="measure boot, symbol loading, stub round trips and probe hit rates")
    _target_options(p, attach=False)
    p.add_argument("--hits", type=_number(int, 1, 10**9), default=2000, help="probe hits to time (default 2000)")
    p.add_argument("--output", type=Path, help="also write the report (markdown) to this file")
    p.add_argument("--sections", type=_sections, default=BENCH_SECTIONS,
                   help="comma-separated parts to run: probes (the cost matrix), scale, gdb (default all three); "
                        "the boot and round-trip rows always run")  # fmt: skip
    p.set_defaults(func=cmd_bench)
    return parser


def _error_prefix() -> str:
    """``qprobe: error: ``, in bold red where stderr is a terminal that has colour (and NO_COLOR is not set)."""
    colour = sys.stderr.isatty() and "NO_COLOR" not in os.environ and os.environ.get("TERM", "dumb") != "dumb"
    return "\x1b[1;31mqprobe: error:\x1b[0m " if colour else "qprobe: error: "


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.ERROR if args.quiet else logging.DEBUG if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="qprobe: %(message)s")
    from qprobe.api import UNWIND_SIGNALS, unwind_on_signal

    # SIGINT is how a trace ends and a booted VM stops (Ctrl-C, bpftrace's and perf's way, and `kill -INT`
    # from a script), also where qprobe was started with SIGINT ignored (`qprobe boot ... &` from a
    # non-interactive shell, or from a process that itself runs so, whose children inherit it).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # SIGTERM and SIGHUP (the terminal went away) unwind like Ctrl-C: probes removed, QEMU stopped.
    for signum in UNWIND_SIGNALS:
        signal.signal(signum, unwind_on_signal)
    try:
        return int(args.func(args) or 0)
    except FetchArgError as exc:
        # The kernel's error_log style: the message, the definition, a caret under the column.
        print(f"{_error_prefix()}{exc.explained}\n{exc.caret()}", file=sys.stderr)
        return 2
    except QprobeError as exc:
        notes = "".join(f" ({note})" for note in getattr(exc, "__notes__", []))
        print(f"{_error_prefix()}{exc}{notes}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("qprobe: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`qprobe blacklist | head`): not an error of ours.  Python would
        # complain again when it flushes stdout at exit, so point stdout at /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
