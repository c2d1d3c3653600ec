"""kprobe_events definitions on a Target: one language for the API, the CLI and the shell.

``target.add_event("p:myread vfs_read count=%dx:u64")`` parses the
definition exactly as the kernel's kprobe_events would, registers a kprobe
(or a kretprobe for ``r``/``%return``) whose handler evaluates the fetch
arguments against the stopped vCPU, and records one ``EventHit`` per hit,
printable as ftrace's trace prints it.  Nothing is written into the guest's
tracing directory: the guest needs no CONFIG_KPROBE_EVENTS.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from qprobe.arch import Arch, RegisterLayout
from qprobe.arch.inguest import GuestFilter, KeyPart, KeySpec, MapSlot
from qprobe.core.kprobe import Kprobe, Kretprobe, KretprobeInstance
from qprobe.core.regs import PtRegs
from qprobe.errors import (
    FetchArgError,
    InvalidProbe,
    NotInstructionBoundary,
    NotKernelText,
    ProbeError,
    QprobeError,
    SymbolError,
)
from qprobe.fetch import (
    MemoryFault,
    ProbeEvent,
    SymbolInfo,
    check_append,
    format_event,
    format_hit,
    parse_event,
    terminal_safe,
)
from qprobe.fetch import messages as M
from qprobe.fetch.args import FetchArg, Value
from qprobe.fetch.context import U64_MASK
from qprobe.fetch.dialect import Dialect
from qprobe.fetch.expr import Arg, Comm, Deref, Imm, ImmString, Node, Reg, StackPointer, SymbolAddr
from qprobe.fetch.filter import EventFilter, GuestReg, Pred, bind
from qprobe.fetch.kstrto import kstrtoul, split_args
from qprobe.funcs import Probeability, check_probe_symbol, did_you_mean, is_glob, wildcard_definitions
from qprobe.kernel.tracefs import within_notrace_func

if TYPE_CHECKING:
    from qprobe.core.kprobe import GuestRecord
    from qprobe.core.kprobes import KprobeManager
    from qprobe.core.kretprobe import KretprobeManager
    from qprobe.kernel.program import KernelData, Task
    from qprobe.kernel.symbols import Symbols
    from qprobe.timeline import Timeline
    from qprobe.vmm.memory import GuestMemory

log = logging.getLogger("qprobe.events")


class ModuleWatch(Protocol):
    """The target's following of module loads (qprobe.modnotify.ModuleNotifier), as events start it."""

    @property
    def started(self) -> bool: ...
    def start(self) -> None: ...


class EventTarget(Protocol):
    """What events use of a target: qprobe.api.Target's public API (and the probe tables it holds)."""

    arch: Arch
    symbols: Symbols
    kernel: KernelData
    mem: GuestMemory
    kprobes: KprobeManager
    kretprobes: KretprobeManager
    events: dict[str, TraceEvent]
    timeline: Timeline

    @property
    def modules(self) -> ModuleWatch: ...

    @property
    def dialect(self) -> Dialect: ...
    @property
    def ftrace_locations(self) -> list[int]: ...
    @property
    def trace_events(self) -> frozenset[tuple[str, str]]: ...
    def current_task(self, regs: PtRegs) -> Task: ...
    def hit_time(self, regs: PtRegs, recorded: bool = False) -> tuple[float, float]: ...
    def add_event(self, definition: str, callback: Callable[[EventHit], None] | None = None,
                  filter: str | None = None) -> TraceEvent: ...  # fmt: skip
    def register_kprobe(self, kp: Kprobe) -> None: ...
    def register_kprobes(self, kps: Iterable[Kprobe]) -> None: ...
    def unregister_kprobe(self, kp: Kprobe) -> None: ...
    def unregister_kprobes(self, kps: Iterable[Kprobe]) -> None: ...
    def register_kretprobe(self, rp: Kretprobe) -> None: ...
    def register_kretprobes(self, rps: Iterable[Kretprobe]) -> None: ...
    def unregister_kretprobe(self, rp: Kretprobe) -> None: ...


@dataclass
class EventHit:
    """One hit of an event, with its arguments formatted as ftrace does."""

    event: str
    cpu: int
    pid: int
    comm: str
    ts: float  # seconds on the guest's trace clock, as its own trace prints them (Target.hit_time)
    addr: int
    symbol: str
    args: dict[str, str]
    body: str  # "(ksys_lseek+0x0/0x90) fd=3 ..."
    irqs_off: bool = False
    func: str | None = None  # a return probe's function (addr and symbol are then the return site)
    numbers: frozenset[str] = frozenset()  # the arguments that are integers (JSON gives them as numbers)
    strings: frozenset[str] = frozenset()  # the string arguments (JSON gives them without ftrace's quotes)
    order: float = 0.0  # where the hit goes among all others (Target.hit_time): push it so to the timeline

    def line(self) -> str:
        """The line ftrace's ``trace`` file would show."""
        flags = ("d" if self.irqs_off else ".") + "...."
        return f"{self.comm:>16}-{self.pid:<7} [{self.cpu:03d}] {flags} {self.ts:12.6f}: {self.event}: {self.body}"

    @property
    def function(self) -> str:
        """The probed function's name (bpftrace's ``func``): a return hit's ``addr`` is in its caller."""
        return (self.func or self.symbol).split("+", 1)[0]

    def escaped(self) -> EventHit:
        """The hit with the control characters of its guest text (the process name, the arguments' text)
        shown as ``\\xNN``: printed to a terminal, a name the guest chose must not act on it."""
        return dataclasses.replace(self, comm=terminal_safe(self.comm), body=terminal_safe(self.body),
                                   args={name: terminal_safe(text) for name, text in self.args.items()})  # fmt: skip

    def as_json(self) -> dict[str, object]:
        """The hit as JSON; a return probe's ``addr``/``symbol`` are its return site, ``func`` its function."""
        out: dict[str, object] = {"event": self.event, "cpu": self.cpu, "pid": self.pid, "comm": self.comm,
                                  "ts": round(self.ts, 6), "addr": f"{self.addr:#x}",
                                  "symbol": self.symbol}  # fmt: skip
        if self.func is not None:
            out["func"] = self.func
        out["args"] = {name: _json_number(text) if name in self.numbers else _json_string(text) if name in self.strings
                       else text for name, text in self.args.items()}  # fmt: skip
        return out


def _json_string(text: str) -> str:
    """A string argument as ftrace prints it (``"workload"``: no escaping inside) as the string; a fault stays text."""
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text


def _json_number(text: str) -> int | str:
    """An integer argument as ftrace formats it (``-5``, ``4096``, ``0x1000``) as a number; a fault stays text."""
    try:
        return int(text, 16) if text.lower().startswith("0x") else int(text, 10)
    except ValueError:
        return text


class _HostContext:
    """The FetchContext of one hit: a stopped vCPU's registers and memory."""

    def __init__(self, target: EventTarget, regs: PtRegs, retval: int | None, comm: str | None = None,
                 ip: int | None = None, entry: dict[int, int] | None = None) -> None:  # fmt: skip
        self.target = target
        self.regs = regs
        self._entry = entry  # a return probe's arguments, as its entry saw them
        self._retval = retval
        self._comm = comm
        self._ip = ip
        self.orig_ax = U64_MASK
        self.task_size_max = target.mem.paging.task_size_max()

    def reg(self, name: str) -> int:
        if name == "orig_ax":
            return self.orig_ax
        if name == "ip" and self._ip is not None:
            return self._ip
        return getattr(self.regs, name)

    def read(self, addr: int, size: int) -> bytes:
        try:
            return self.regs.read(addr, size)
        except QprobeError:
            raise MemoryFault(addr, size) from None

    read_user = read  # the interrupted task's page tables map its user memory too

    def stack(self, n: int) -> int:
        try:
            return self.regs.stack(n)
        except QprobeError:
            return 0

    def stack_pointer(self) -> int:
        return self.regs.sp

    def retval(self) -> int:
        return self.regs.return_value() if self._retval is None else self._retval

    def comm(self) -> str:
        return self._comm if self._comm is not None else self.target.current_task(self.regs).comm

    def arg(self, n: int) -> int:
        if self._entry is not None:
            return self._entry[n]
        return self.regs.arg(n)

    def symbol_address(self, name: str) -> int:
        return self.target.symbols.address(name)

    def symbolize(self, addr: int) -> str:
        info = _lookup(self.target)(addr)
        return f"{info.name}+{info.offset:#x}/{info.size:#x}" if info else f"{addr:#x}"


def _lookup(target: EventTarget) -> Callable[[int], SymbolInfo | None]:
    def lookup(addr: int) -> SymbolInfo | None:
        sym = target.symbols.containing(addr)
        return None if sym is None else SymbolInfo(sym.name, addr - sym.addr, target.symbols.kallsyms_size(sym))

    return lookup


@dataclass
class TraceEvent:
    """A kprobe_events definition armed on a target."""

    target: EventTarget
    definition: ProbeEvent
    callback: Callable[[EventHit], None] | None = None
    keep: int = 100_000  # hits kept in ``hits``; older ones fall out, counted in ``evicted``
    hits: collections.deque[EventHit] = field(default_factory=collections.deque)
    evicted: int = 0  # hits delivered (to the callback too) that fell out of ``hits`` since
    nhit: int = 0
    probe: Kprobe | Kretprobe | None = None
    errors: list[str] = field(default_factory=list)
    filter: EventFilter | None = None
    in_guest: bool = False  # recorded by an optimized probe's detour when it can be (see in_guest())
    host_filtered: int = 0  # hits the filter rejected on the host (the rest were rejected in the guest)
    guest_map: tuple[tuple[str, ...], str | None, bool] | None = None  # count_in_guest's keys, value, hist
    appended: list[TraceEvent] = field(default_factory=list)  # later probes of the same event
    anywhere: bool = False  # armed with stub breakpoints (Kprobe(anywhere=True)), also when its module loads

    @functools.cached_property
    def numbers(self) -> frozenset[str]:
        """The arguments whose values are integers (JSON gives them as numbers)."""
        return self.definition.integer_args

    @functools.cached_property
    def strings(self) -> frozenset[str]:
        """The arguments whose values are strings (JSON gives them without ftrace's quotes)."""
        return self.definition.string_args

    def probes(self) -> list[TraceEvent]:
        """This definition and every one appended to the event, in the order they were added."""
        return [self, *self.appended]

    @property
    def name(self) -> str:
        return f"{self.definition.group}/{self.definition.event}"

    @property
    def nmissed(self) -> int:
        return self.probe.nmissed if self.probe is not None else 0

    @property
    def filtered(self) -> int:
        """Hits the filter rejected: on the host, or in the guest by an optimized probe's detour."""
        return self.host_filtered + (self.probe.nfiltered if isinstance(self.probe, Kprobe) else 0)

    @property
    def lost(self) -> int:
        """Hits whose records never reached the host: dropped in the guest on a full ring (a lossy one, or one
        the host stopped draining), counted in nmissed too.  A hit delivered and later fallen out of ``hits``
        is not lost but ``evicted``."""
        if isinstance(self.probe, Kretprobe):
            return self.probe.kp.nlost
        return self.probe.nlost if self.probe is not None else 0

    def listing(self) -> str:
        """The lines ``cat kprobe_events`` shows for the event, one per probe."""
        return "\n".join(format_event(te.definition, te.maxactive) for te in self.probes())

    @property
    def maxactive(self) -> int:
        """A return probe's instance count as the kernel lists it (the default resolved), else 0."""
        if isinstance(self.probe, Kretprobe):
            return self.probe.maxactive or self.target.kretprobes.default_maxactive()
        return self.definition.maxactive

    def _record(
        self, regs: PtRegs, ip: int, func: int | None, retval: int | None,
        task: tuple[int, str] | None = None, entry: dict[int, int] | None = None,
    ) -> None:  # fmt: skip
        """One hit at ``ip`` (a kprobe's address, or a return probe's real return address in ``func``).

        ``%ip`` is what the kernel's handler sees: in a kprobe the probe's address plus the
        arch's ``kprobe_ip_offset`` (x86: + 1, the int3 has run; its optimized and ftrace-based
        probes set the same), and the real return address in a return probe.
        """
        recorded = task is not None  # only a ring record brings its task
        ctx = _HostContext(self.target, regs, retval, None if task is None else task[1],
                           ip=ip + self.target.arch.kprobe_ip_offset if func is None else ip, entry=entry)  # fmt: skip
        # -1 as the int3 entry and the kretprobe trampoline leave it; 0 in a probe the kernel would run
        # from ftrace (one qprobe moved off an __fentry__ site), whose pt_regs come from ftrace_regs_caller.
        probe = self.probe if isinstance(self.probe, Kprobe) else None
        ctx.orig_ax = 0 if func is None and probe is not None and probe.at != probe.resolved else U64_MASK
        values: list[Value] = self.definition.evaluate(ctx)
        body = format_hit(self.definition, values, ip, func, lookup=_lookup(self.target),
                          trampoline=self.target.kretprobes.trampoline or None)  # fmt: skip
        if task is None:
            current = self.target.kernel.snapshot(gs_base=regs.gs_base)
            # Without the kernel's types (a vmlinux without DWARF) the task is unknown: ftrace's "<...>".
            task = (current.pid, current.comm) if current is not None else (-1, "<...>")
        pid, comm = task
        ts, order = self.target.hit_time(regs, recorded=recorded)
        hit = EventHit(
            event=self.definition.event, cpu=regs.vcpu, pid=pid, comm=comm,
            ts=ts, order=order, addr=ip,
            symbol=self.target.symbols.symbolize(ip),
            func=None if func is None else self.target.symbols.symbolize(func),
            args={a.name: a.format_value(v) for a, v in zip(self.definition.args, values, strict=True)},
            body=body, irqs_off=not regs.flags & self.target.arch.registers.irq_flag, numbers=self.numbers,
            strings=self.strings,
        )  # fmt: skip
        if self.filter is not None and not self.filter(
            {**hit.args, "common_pid": hit.pid, "pid": hit.pid, "comm": hit.comm, "cpu": hit.cpu}
        ):
            self.host_filtered += 1
            return
        self.nhit += 1
        self.target.timeline.push(hit.order, lambda: self._keep(hit), hit)  # its time, as the guest's clock prints
        if self.callback is not None:
            self.callback(hit)  # at the hit, like a kernel handler; printers order through the timeline

    def _keep(self, hit: EventHit) -> None:
        """Keep ``hit`` in ``hits``, in the guest's order of hits across every event (qprobe.timeline)."""
        if len(self.hits) >= self.keep:
            self.hits.popleft()
            self.evicted += 1
        self.hits.append(hit)

    def _kprobe_hit(self, kp: Kprobe, regs: PtRegs) -> int:
        self._record(regs, kp.at, None, None)
        return 0

    def use_host_handler(self, on: bool) -> None:
        """While on, every hit runs the Python handler at the hit (to unwind its stack, say), never a record."""
        if isinstance(self.probe, Kprobe) and self.in_guest:
            self.probe.recorder = None if on else self._guest_record
            self.target.kprobes.resync(self.probe)

    def count_in_guest(self, keys: Sequence[str], value: str | None = None, hist: bool = False) -> bool:
        """Fold hits into a map in guest RAM instead of recording them: counted by ``keys``, and
        ``value``'s sum, min and max kept (its hist() bucket the key's last part with ``hist``).

        For an event recorded in the guest, with no filter, whose key parts are ``$comm``,
        ``$pid``, ``$cpu``, ``$func``, ``$event`` or integers taken from registers, and whose
        value is such an integer; otherwise returns False and changes nothing.  Hits the host
        still sees (before the jump is placed, or while it cannot be) reach ``callback`` as
        usual; ``stop_counting_in_guest`` returns the rest.
        """
        kp = self.probe
        layout = self.target.arch.registers
        spec = guest_key(self.definition, keys, value, hist, layout) if self.filter is None else None
        if spec is None or not isinstance(kp, Kprobe) or self.target.kprobes.optimizer is None:
            return False
        self.guest_map = (tuple(keys), value, hist)
        self.target.kprobes.resync(kp, lambda: setattr(kp, "guest_key", spec))
        return True

    def stop_counting_in_guest(self) -> dict[tuple[str | int, ...], MapSlot]:
        """End ``count_in_guest``: the hits folded in the guest, by key (its parts as the host formats them,
        the hist() bucket last with ``hist``)."""
        kp, kprobes = self.probe, self.target.kprobes
        if not isinstance(kp, Kprobe) or kp.guest_key is None or kprobes.optimizer is None or self.guest_map is None:
            return {}
        spec, opt = kp.guest_key, kprobes.optimizer
        raw: dict[tuple[int, ...], MapSlot] = {}

        def take() -> None:  # in the stop that puts the recording detour back: no hit is lost in between
            point = kprobes.points.get(kp.resolved)
            if point is not None:
                raw.update(opt.keyed_counts(point, spec))
            kp.guest_key = None

        kprobes.resync(kp, take)
        self.nhit += sum(slot.count for slot in raw.values())
        keys, _value, hist = self.guest_map
        self.guest_map = None
        args = {a.name: a for a in self.definition.args}
        layout = self.target.arch.registers
        general = [layout.gdb_name[r] for r in layout.general]
        rest = {layout.gdb_name[r]: 0 for r in (layout.ip, layout.sp, layout.flags)}

        def formatted(name: str, word: int) -> str:  # the argument's text, as a hit with that register shows it
            regs = kprobes.make_regs({**dict.fromkeys(general, word), **rest}, kprobes.machine.vcpus[0])
            return args[name].format_value(args[name].evaluate(_HostContext(self.target, regs, None)))

        out: dict[tuple[str | int, ...], MapSlot] = {}
        for words, slot in raw.items():
            it = iter(words)
            parts: list[str | int] = []
            for name in (*keys, *(("$hist",) if hist else ())):
                if name in ("$func", "$event"):
                    parts.append(self.function_name if name == "$func" else self.definition.event)
                elif name == "$comm":
                    parts.append((next(it).to_bytes(8, "little") + next(it).to_bytes(8, "little"))
                                 .split(b"\0")[0].decode(errors="replace"))  # fmt: skip
                elif name == "$pid":
                    pid = next(it)
                    parts.append(pid - (1 << 32) if pid >> 31 else pid)
                elif name in ("$cpu", "$hist"):
                    parts.append(next(it))
                else:
                    parts.append(formatted(name, next(it)))
            key = tuple(parts)
            old = out.get(key)
            out[key] = slot if old is None else old.merge(slot)
        return out

    @property
    def function_name(self) -> str:
        """``$func`` of every hit of this event: the probed function's name, as ``EventHit.function`` gives it."""
        kp = self.probe.kp if isinstance(self.probe, Kretprobe) else self.probe
        assert kp is not None, "an event is armed before it is hit"
        return self.target.symbols.symbolize(kp.at).split("+", 1)[0]

    def _guest_record(self, rec: GuestRecord) -> None:
        """The same hit, recorded in the guest by an optimized probe's detour and drained from its ring."""
        kprobes = self.target.kprobes
        regs = kprobes.make_regs(rec.values, kprobes.machine.vcpus[rec.cpu])
        assert isinstance(self.probe, Kprobe)
        self._record(regs, self.probe.at, None, None, task=(rec.pid, rec.comm))

    def _kretprobe_entry(self, ri: KretprobeInstance, regs: PtRegs) -> int:
        """``store_trace_entry_data``: the arguments a return probe's ``$argN`` fetch, saved at the entry."""
        for i, n in enumerate(entry_args(self.definition)):
            try:
                value = regs.arg(n)
            except QprobeError:
                value = 0  # regs_get_kernel_argument: 0 where the stack slot cannot be read
            ri.data[8 * i : 8 * i + 8] = (value & U64_MASK).to_bytes(8, "little")
        return 0

    def _kretprobe_hit(self, ri: KretprobeInstance, regs: PtRegs) -> None:
        func = self.probe.kp.at  # type: ignore[union-attr]
        saved = {n: int.from_bytes(ri.data[8 * i : 8 * i + 8], "little")
                 for i, n in enumerate(entry_args(self.definition))}  # fmt: skip
        self._record(regs, ri.ret_addr, func, regs.return_value(), entry=saved)


def _register_only(node: Node, layout: RegisterLayout) -> bool:
    """Whether a fetch argument's value is in the registers at the hit (no memory read)."""
    match node:
        case Reg() | StackPointer() | Imm() | ImmString() | Comm():
            return True
        case Arg(n):
            return n <= len(layout.arg_regs)  # the later ones are on the stack
        case SymbolAddr(_, _, offset):
            return offset is not None
    return False


def entry_args(ev: ProbeEvent) -> list[int]:
    """The argument numbers a return probe's ``$argN`` (or BTF parameter) fetches, in order, each once."""
    out: list[int] = []
    for a in ev.args:
        node = a.expr
        while isinstance(node, Deref):
            node = node.inner
        if isinstance(node, Arg) and node.n not in out:
            out.append(node.n)
    return out


def in_guest(ev: ProbeEvent, layout: RegisterLayout) -> bool:
    """Can an optimized probe record this event in the guest (a register snapshot), waking nobody?

    Only when every fetch argument comes from the registers (or is $comm, which the
    record carries): a memory dereference must be read at the hit, which needs the host.
    """

    def ok(a: FetchArg) -> bool:
        if a.type.string:  # a string is read from memory, except these two
            return isinstance(a.expr, Comm | ImmString)
        return _register_only(a.expr, layout) and not a.type.array

    return not ev.is_return and all(ok(a) for a in ev.args)


def _arg_register(a: FetchArg, layout: RegisterLayout) -> str | None:
    """The general-purpose register (a pt_regs name) an argument is taken from as it is, if it is one."""
    match a.expr:
        case Reg(name) if name in layout.general:
            return name
        case Arg(n) if n <= len(layout.arg_regs):
            return layout.arg_regs[n - 1]
    return None


GUEST_KEYS = {"$comm": KeyPart("comm"), "$pid": KeyPart("pid"), "$cpu": KeyPart("cpu")}


def guest_key(ev: ProbeEvent, keys: Sequence[str], value: str | None, hist: bool,
              layout: RegisterLayout) -> KeySpec | None:  # fmt: skip
    """A map by ``keys`` of ``value`` as a key the detour can compute, or None if only the host can.

    A key part is ``$comm``, ``$pid``, ``$cpu``, ``$func`` or ``$event`` (the last two the same for
    every hit: the host adds them) or an integer argument taken from a register as it is; the value
    such an argument of a numeric type (u/s/x), since the host folds the number its text shows.
    """
    if not in_guest(ev, layout) or (hist and value is None):
        return None
    args = {a.name: a for a in ev.args}

    def register(name: str, numeric: bool) -> KeyPart | None:
        a = args.get(name)
        if a is None:
            return None
        t, reg = a.type, _arg_register(a, layout)
        if reg is None or t.string or t.array or t.bitfield or t.size not in (1, 2, 4, 8):
            return None
        if numeric and not (t.name[:1] in ("u", "s", "x") and t.name[1:].isdigit()):
            return None
        return KeyPart("reg", reg, t.size * 8, t.signed)

    parts: list[KeyPart] = []
    for name in keys:
        if name in ("$func", "$event"):
            continue
        part = GUEST_KEYS.get(name) or register(name, False)
        if part is None:
            return None
        parts.append(part)
    folded = register(value, True) if value is not None else None
    if value is not None and folded is None:
        return None
    if hist and folded is not None:
        return KeySpec((*parts, dataclasses.replace(folded, kind="hist")))
    return KeySpec(tuple(parts), folded)


def guest_filter(ev: ProbeEvent, flt: EventFilter, layout: RegisterLayout) -> GuestFilter | None:
    """The filter bound to registers, for an optimized probe's detour to run, or None if it needs the host.

    Every predicate must compare a 64- or 32-bit integer argument taken from a
    register with a constant in that type's range; common fields (pid, comm,
    cpu) and strings are only known on the host.
    """
    args = {a.name: a for a in ev.args}

    def where(p: Pred) -> GuestReg | None:
        a = args.get(p.field)
        if a is None or not isinstance(p.const, int):
            return None
        t, reg = a.type, _arg_register(a, layout)
        if reg is None or t.string or t.array or t.bitfield or t.symbol or t.size not in (4, 8):
            return None
        bits = t.size * 8
        lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if t.signed else (0, (1 << bits) - 1)
        return GuestReg(reg, bits, t.signed) if lo <= p.const <= hi else None

    return bind(flt.tree, where) if in_guest(ev, layout) else None


def event_filter(ev: ProbeEvent, text: str) -> EventFilter:
    """An ftrace filter over ``ev``'s arguments; raises FetchArgError (with a column) naming the problem."""
    return EventFilter(text, numeric={a.name for a in ev.args if not a.type.string},
                       strings={a.name for a in ev.args if a.type.string})  # fmt: skip


def on_func_entry(target: EventTarget, symbol: str, offset: int) -> bool:
    """``kprobe_on_func_entry``: is ``symbol+offset`` the entry of the function that contains it?

    The kernel resolves the address to the kallsyms symbol containing it (so
    ``ksys_lseek+SIZE`` is the next function's entry) and, on x86, counts the
    byte after an ``endbr64`` as the entry too (``arch_adjust_kprobe_addr``).
    """
    addr = target.symbols.address(symbol) + offset
    sym = target.symbols.containing(addr)
    return sym is not None and addr - sym.addr in (0, target.kprobes.sites.entry_skip(sym.addr))


def _suggesting(target: EventTarget, exc: FetchArgError) -> FetchArgError:
    """The kernel's refusal of an unknown probe symbol, with the names it was probably meant to be."""
    words = split_args(exc.text.split("#", 1)[0])
    if exc.detail or len(words) < 2 or exc.column != words[1][0]:
        return exc
    symbol = re.split(r"[+%]", words[1][1], maxsplit=1)[0]
    if not symbol or symbol in target.symbols or kstrtoul(symbol, 0) is not None:
        return exc
    if is_glob(symbol):
        detail = "a wildcard makes one event per function: add_events()"
        return FetchArgError(exc.reason, exc.text, exc.column, logged=exc.logged, detail=detail)
    hint = did_you_mean(target.symbols.names(), symbol)
    return FetchArgError(exc.reason, exc.text, exc.column, logged=exc.logged, detail=f"no symbol {symbol!r}{hint}")


def _follow_modules(target: EventTarget, text: str) -> None:
    """Know the guest's modules before a definition whose probe point may be in one is checked.

    ``MOD:SYM`` names a module's symbol; a plain name vmlinux lacks may be one
    (kallsyms_lookup_name searches modules after vmlinux).  Without the
    kernel's debug info a plain name stays unknown, and ``MOD:SYM`` is refused.
    """
    words = split_args(text.split("#", 1)[0])
    if len(words) < 2 or words[0][1][:1] not in ("p", "r"):
        return
    name = re.split(r"[+%]", words[1][1], maxsplit=1)[0]
    if not name or name[0].isdigit() or is_glob(name) or name in target.symbols or target.modules.started:
        return
    try:
        target.modules.start()
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
    words = split_args(ev.text.split("#", 1)[0])
    return FetchArgError(dialect.message(message), ev.text, words[1][0] if len(words) > 1 else 0, detail=str(exc))


def add_event(
    target: EventTarget,
    text: str,
    callback: Callable[[EventHit], None] | None = None,
    filter: str | None = None,
    anywhere: bool = False,
) -> TraceEvent:
    """Parse a kprobe_events definition and arm it; raises FetchArgError naming the problem.

    Refusals are the kernel's (its texts and carets, ``error_log`` style), including
    those it makes when it adds the probe to its event table or registers it;
    ``anywhere`` arms it with a stub breakpoint (``Kprobe(anywhere=True)``).
    """
    _follow_modules(target, text)
    te, first = _prepare(target, text, callback, filter, target.symbols.count, anywhere)
    try:
        _register(target, te)
    except (ProbeError, SymbolError) as exc:
        ev, symbols = te.definition, target.symbols
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
            raise _registration_error(ev, exc, target.dialect) from exc
    if first is not None:
        first.appended.append(te)
    else:
        target.events[te.name] = te
    return te


@dataclass
class Wildcard:
    """The events a definition on a glob made: one per function that could be probed, and the refusals."""

    pattern: str
    events: list[TraceEvent]
    refused: dict[str, str]  # function -> why it was not probed


MAX_WILDCARD = 1000  # probes one glob may arm: more is almost always a pattern wider than meant


def add_events(
    target: EventTarget,
    text: str,
    callback: Callable[[EventHit], None] | None = None,
    filter: str | None = None,
    anywhere: bool = False,
) -> Wildcard:
    """A definition whose probe point is a glob (``p:vfs vfs_* fd=%di``): every match that can be probed, at once.

    Each function gets its own event (see ``wildcard_definitions``); the ones the kernel
    would refuse (notrace, blacklisted, not unique...) or whose definition it would refuse
    are counted in ``refused`` with the reason.  The probes are registered as one batch.
    """
    words = split_args(text.split("#", 1)[0])
    pattern = re.match(r"[^+%]*", words[1][1] if len(words) > 1 else "").group(0)  # type: ignore[union-attr]
    prob = Probeability.of_target(target)
    prob.anywhere = anywhere
    found = check_probe_symbol(prob, pattern)
    if not found:
        raise FetchArgError("not a wildcard: use add_event()", text, words[1][0] if len(words) > 1 else 0)
    refused = {f.name: f.reason for f in found if f.reason is not None}
    definitions = wildcard_definitions(text, [f.name for f in found if f.reason is None])
    if len(definitions) > MAX_WILDCARD:
        raise ProbeError(f"{pattern!r} matches {len(definitions)} functions that can be probed; "
                         f"qprobe arms at most {MAX_WILDCARD} at once (narrow the pattern)")  # fmt: skip
    prepared: list[TraceEvent] = []
    for func, definition in definitions:
        try:
            te, first = _prepare(target, definition, callback, filter, lambda _name: 1, anywhere)  # unique above
        except FetchArgError as exc:
            refused[func] = exc.explained
            continue
        if first is not None:
            refused[func] = f"{target.dialect.message(M.EVENT_EXIST)} ({te.name})"
            continue
        prepared.append(te)
    try:
        _register_batch(target, prepared)
    except ProbeError:
        # One the host's checks passed was refused when registered: find which, one by one.
        armed = []
        for te in prepared:
            try:
                _register(target, te)
            except ProbeError as exc:
                refused[te.definition.symbol or ""] = str(exc)
                continue
            armed.append(te)
        prepared = armed
    for te in prepared:
        target.events[te.name] = te
    return Wildcard(pattern, prepared, dict(sorted(refused.items())))


def _prepare(
    target: EventTarget, text: str, callback: Callable[[EventHit], None] | None, filter: str | None,
    symbol_count: Callable[[str], int], anywhere: bool,
) -> tuple[TraceEvent, TraceEvent | None]:  # fmt: skip
    """The parsed, checked, unregistered event, and the existing event it would join (or None)."""
    symbols, dialect = target.symbols, target.dialect
    try:
        ev = parse_event(text, symbol_exists=lambda name: name in symbols, dialect=dialect, symbol_count=symbol_count,
                         on_func_entry=lambda sym, off: on_func_entry(target, sym, off))  # fmt: skip
    except FetchArgError as exc:
        raise _suggesting(target, exc) from None
    if not isinstance(ev, ProbeEvent):
        raise FetchArgError("use remove_event() to delete an event", text, 0, logged=False)
    name = f"{ev.group}/{ev.event}"
    first = target.events.get(name)
    # register_trace_kprobe: a definition naming an existing event appends a probe to it.
    check_append(ev, [te.definition for te in first.probes()] if first else [], dialect)
    if first is None and (ev.group, ev.event) in target.trace_events:
        raise FetchArgError(dialect.message(M.EVENT_EXIST), text, 0)
    te = TraceEvent(target, ev, callback, filter=None if filter is None else event_filter(ev, filter))
    if not anywhere and ev.symbol is not None and ev.symbol in symbols and within_notrace_func(
            symbols, target.ftrace_locations, symbols.address(ev.symbol) + ev.offset):  # fmt: skip
        # __register_trace_kprobe: "Could not probe notrace function", -EINVAL.
        raise _registration_error(ev, InvalidProbe(f"{ev.symbol} is a notrace function (EINVAL)"), dialect)
    te.anywhere = anywhere
    _make_probe(te)
    return te, first


def _make_probe(te: TraceEvent) -> None:
    """The event's kprobe or kretprobe, not yet registered."""
    ev = te.definition
    if ev.is_return:
        saved = entry_args(ev)  # fetched at the entry, as the kernel's trace_kprobe_entry_handler does
        te.probe = Kretprobe(symbol_name=ev.symbol, addr=ev.addr if ev.symbol is None else None, offset=ev.offset,
                             maxactive=ev.maxactive, handler=te._kretprobe_hit, data_size=8 * len(saved),
                             entry_handler=te._kretprobe_entry if saved else None,
                             anywhere=te.anywhere)  # fmt: skip
        return
    kp = Kprobe(symbol_name=ev.symbol, addr=ev.addr if ev.symbol is None else None, offset=ev.offset,
                pre_handler=te._kprobe_hit, anywhere=te.anywhere)  # fmt: skip
    layout = te.target.arch.registers
    if in_guest(ev, layout) and not te.anywhere:  # a stub breakpoint is never jump-optimized
        te.in_guest = True
        kp.recorder = te._guest_record
        if te.filter is not None:
            # Rejected in the detour, before the ring; the host filter still runs (the int3 path).
            kp.guest_filter = guest_filter(ev, te.filter, layout)
    te.probe = kp


def register_probe(target: EventTarget, te: TraceEvent) -> None:
    """Make the event's probe anew from its definition and register it (a module's event, when it loads)."""
    _make_probe(te)
    _register(target, te)


def _register(target: EventTarget, te: TraceEvent) -> None:
    if isinstance(te.probe, Kretprobe):
        target.register_kretprobe(te.probe)
    elif te.probe is not None:
        target.register_kprobe(te.probe)


def _register_batch(target: EventTarget, events: list[TraceEvent]) -> None:
    """All or nothing, the kprobes in one batch (one grace period places every jump), then the kretprobes."""
    kps = [te.probe for te in events if isinstance(te.probe, Kprobe)]
    rps = [te.probe for te in events if isinstance(te.probe, Kretprobe)]
    target.register_kprobes(kps)
    try:
        target.register_kretprobes(rps)
    except BaseException:
        target.unregister_kprobes(kps)
        raise


def remove_events(target: EventTarget, events: Iterable[TraceEvent]) -> None:
    """Disarm every probe of the events (each one's first definition and those appended to it).

    The entry probes go in one batch, as ``add_events`` armed them: one VM stop for any number.
    """
    ones = [one for te in events for one in te.probes()]
    target.unregister_kprobes([one.probe for one in ones if isinstance(one.probe, Kprobe)])
    for one in ones:
        if isinstance(one.probe, Kretprobe):
            target.unregister_kretprobe(one.probe)
