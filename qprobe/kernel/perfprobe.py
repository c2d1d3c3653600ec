"""perf probe's definition language, resolved from vmlinux's DWARF into a kprobe_events definition.

``perf probe 'vfs_read:23 ret file->f_pos'`` names a source line and C
variables; what it writes to kprobe_events (``perf probe -n -v`` prints it) is
an address and fetch arguments: ``p:probe/vfs_read_L23 vfs_read+168
ret=%bx:s64 f_pos=+104(%bp):s64``.  This module makes the same translation,
following tools/perf/util/probe-event.c and probe-finder.c (Linux 6.1), with
gdb's DWARF reader doing what libdw does for perf:

* the probe point: ``FUNC`` is the function's entry (perf skips the prologue
  only for code built without optimization, and kernels are built -O2),
  ``FUNC+OFFS`` that byte, ``FUNC:RLN`` the first is_stmt address of line
  decl_line+RLN inside the function, ``SRC:ALN`` the first is_stmt address of
  that line, ``%return`` a return probe;
* each variable's location at that address (``info scope``): a register is
  ``%reg``, a register plus offset (DW_OP_breg, or DW_OP_fbreg over a register
  frame base) is ``+OFF(%reg)``, a static variable ``+0(@name)``; a location
  list that does not cover the address is "optimized out here", and any other
  DWARF expression is refused, as perf refuses it;
* ``->``, ``.`` and ``[N]`` add dereferences and offsets (perf's
  convert_variable_fields), and the type is perf's: ``s``/``x`` (``u`` where the
  kernel has no hexadecimal types) and the DWARF type's size in bits, or the
  ``:TYPE`` given; an argument without ``NAME=`` is named after its last member.

The probe point is written ``FUNC+OFF`` where perf writes ``_text+OFF``: the
same address, in the form qprobe checks against vmlinux's symbols.

The definition is parsed by :mod:`qprobe.kernel.perfsyntax`, and gdb's answers
are read by :mod:`qprobe.kernel.perfdwarf`; perf's rules for what they become
are here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from qprobe.arch import Arch
from qprobe.kernel.debuginfo import need_dwarf
from qprobe.kernel.perfdwarf import (
    GdbDwarf,
    Location,
    first_covered,
    line_address,
    location_at,
    parse_location,
    parse_scope,
)
from qprobe.kernel.perfsyntax import (
    PERF_PREFIX,
    PerfArg,
    PerfProbe,
    PerfProbeError,
    is_perf_definition,
)

if TYPE_CHECKING:
    from qprobe.kernel.symbols import Symbols

DEFAULT_GROUP = "probe"  # perf's PERFPROBE_GROUP
MAX_BASIC_TYPE_BITS = 64


# -- fetch arguments (pure) ----------------------------------------------------------------------
def fetch_text(loc: Location, steps: Sequence[tuple[str, int]], var: str) -> str:
    """The fetch argument for a location and the walk's steps (perf's synthesize_probe_trace_arg)."""
    refs = loc.refs()
    for op, off in steps:
        if op == "deref":
            refs.append(off)
        elif not refs:
            raise PerfProbeError(f"{var}: a structure in a register cannot be fetched by member")
        else:
            refs[-1] += off
    text = loc.base
    for off in refs:
        text = f"{off:+d}({text})"
    return text


def fetch_type(info: dict[str, Any], cast: str | None, hex_types: bool, var: str) -> tuple[str | None, bool]:
    """perf's type for a value (convert_variable_type): (type, whether a string needs one more dereference)."""
    if cast in ("string", "ustring"):
        if info["kind"] not in ("pointer", "array"):
            raise PerfProbeError(f"{var} is not a pointer nor array: it cannot be a string")
        if info["target"] not in ("char", "unsigned char"):
            raise PerfProbeError(f"{var} is not (unsigned) char *: it cannot be a string")
        return cast, info["kind"] == "pointer"
    if cast and cast not in ("s", "u", "x"):
        return cast, False
    if info.get("bitfield"):
        raise PerfProbeError(f"{var} is a bitfield, which qprobe's perf translation does not fetch")
    if (cast == "x" and hex_types) or cast in ("s", "u"):
        prefix = cast
    else:
        prefix = "s" if info["signed"] else "x" if hex_types else "u"
    size = info["size"] * 8
    if size <= 0:
        return None, False
    return f"{prefix}{min(size, MAX_BASIC_TYPE_BITS)}", False


# -- the resolver -------------------------------------------------------------------------------
class Dwarf(Protocol):
    """What the translation asks of the debug information (gdb's, through :class:`GdbDwarf`)."""

    def function(self, name: str) -> dict[str, Any] | None: ...
    def symtab_files(self, spec: str) -> list[str]: ...
    def line_table(self, file: str) -> list[tuple[int, int, bool]]: ...
    def scope(self, addr: int) -> str: ...
    def access(self, var: str, addr: int, fields: Sequence[tuple[str, str]]) -> dict[str, Any]: ...


class Functions(Protocol):
    """vmlinux's symbol table: where each function starts and how long it is."""

    def function_range(self, name: str) -> tuple[int, int] | None: ...
    def function_at(self, addr: int) -> tuple[str, int] | None: ...


@dataclass(frozen=True)
class Translation:
    definition: str  # the kprobe_events line
    function: str
    offset: int


def translate(probe: PerfProbe, dwarf: Dwarf, funcs: Functions, hex_types: bool,
              pt_name: Mapping[str, str]) -> Translation:  # fmt: skip
    """The kprobe_events definition perf probe would write for ``probe``."""
    where = probe.text.split(None, 1)[0] if not is_perf_definition(probe.text) else probe.text.split()[1]
    if probe.lazy is not None:
        raise PerfProbeError(f"{where}: ;PATTERN matches source text, which is not on the host; use :LINE")
    if probe.function:
        fn = dwarf.function(probe.function)
        span = funcs.function_range(probe.function)
        if fn is None or span is None:
            raise PerfProbeError(f"{where}: no function {probe.function} in vmlinux's debug information"
                                 if span is not None or fn is None else
                                 f"{where}: {probe.function} is inlined everywhere; probe its callers")  # fmt: skip
        if probe.file and not fn["file"].endswith(probe.file):
            raise PerfProbeError(f"{where}: {probe.function} is in {fn['file']}, not {probe.file}")
        start, size = span
        if probe.line is not None:
            line = fn["line"] + probe.line
            rows = dwarf.line_table(fn["file"])
            addr = line_address(rows, line, start, start + size)
            if addr is None:
                raise PerfProbeError(f"{where}: no code for line {line} of {fn['file']} in {probe.function}")
        else:
            if probe.offset >= size:
                raise PerfProbeError(f"{where}: +{probe.offset} is past the end of {probe.function} ({size} bytes)")
            addr = start + probe.offset
        func = probe.function
    else:
        assert probe.file is not None and probe.line is not None
        files = dwarf.symtab_files(f"{probe.file}:{probe.line}")
        addr = None
        for file in files:
            addr = line_address(dwarf.line_table(file), probe.line)
            if addr is not None:
                break
        if addr is None:
            raise PerfProbeError(f"{where}: no code for line {probe.line} of {probe.file}")
        at = funcs.function_at(addr)
        if at is None:
            raise PerfProbeError(f"{where}: line {probe.line} is at {addr:#x}, in no function of vmlinux")
        func, start = at
        span = funcs.function_range(func)
        size = span[1] if span else 0
    offset = addr - start
    args = [_arg_text(arg, probe, dwarf, addr, (start, start + size), hex_types, pt_name) for arg in probe.args]
    if probe.event:
        event = probe.event
    elif probe.function and probe.line is not None:
        event = f"{func}_L{probe.line}"
    else:
        event = func + ("__return" if probe.is_return else "")
    event = re.sub(r"[^A-Za-z0-9_]", "_", event)  # perf's names for .isra.0/.constprop.0 functions
    head = f"{'r' if probe.is_return else 'p'}:{probe.group or DEFAULT_GROUP}/{event}"
    point = func if offset == 0 else f"{func}+{offset}"
    return Translation(" ".join([head, point, *args]), func, offset)


def _arg_text(arg: PerfArg, probe: PerfProbe, dwarf: Dwarf, addr: int, span: tuple[int, int],
              hex_types: bool, pt_name: Mapping[str, str]) -> str:  # fmt: skip
    name = arg.event_name
    if not arg.is_c_var:  # $retval, $comm, %reg, @sym, +8(%di): kprobe_events' own, passed through as perf does
        text = arg.text.split("=", 1)[-1] if arg.name else arg.text
        return f"{arg.name}={text}" if arg.name else text
    shown = arg.text.split("=", 1)[-1].partition(":")[0]
    found = dwarf.access(arg.var, addr, arg.fields)
    if found.get("error") == "notfound":
        raise PerfProbeError(f"{_where(probe)}: no variable {arg.var} here")
    if "error" in found:
        raise PerfProbeError(f"{_where(probe)}: {shown}: {found['error']}")
    if found["global"]:
        loc = Location(f"@{arg.var}", 0)
    else:
        scope = parse_scope(dwarf.scope(addr))
        if arg.var not in scope:
            scope = {**parse_scope(dwarf.scope(span[0])), **scope}  # the function's outermost block
        entry = scope.get(arg.var)
        if entry is None:
            raise PerfProbeError(f"{_where(probe)}: no variable {arg.var} here")
        desc = location_at(entry, addr)
        if desc is None and addr == span[0] and found["argument"]:
            desc = first_covered(entry, *span)
        if desc is None:
            raise PerfProbeError(f"{_where(probe)}: {arg.var} is optimized out here (its location list does not cover "
                                 f"{addr:#x})")  # fmt: skip
        try:
            loc = parse_location(desc, arg.var, pt_name)
        except PerfProbeError as exc:
            raise PerfProbeError(f"{_where(probe)}: {exc}") from None
    steps = [(op, int(off)) for op, off in found["steps"]]
    typ, deref = fetch_type(found["type"], arg.type, hex_types, shown)
    if deref:
        steps.append(("deref", 0))
    text = fetch_text(loc, steps, shown)
    return f"{name}={text}" + (f":{typ}" if typ else "")


def _where(probe: PerfProbe) -> str:
    words = probe.text.split()
    return words[1] if words[0] == PERF_PREFIX and len(words) > 1 else words[0]


# -- gdb on vmlinux ----------------------------------------------------------------------------
@dataclass(frozen=True)
class SymbolFunctions:
    """:class:`Functions` from vmlinux's ELF symbols, at link-time addresses (gdb's) whatever the slide."""

    symbols: Symbols

    def function_range(self, name: str) -> tuple[int, int] | None:
        if name not in self.symbols:
            return None
        sym = self.symbols.lookup(name)
        return (sym.addr - self.symbols.slide, sym.size) if sym.kind == "func" and sym.size else None

    def function_at(self, addr: int) -> tuple[str, int] | None:
        sym = self.symbols.function(addr + self.symbols.slide)
        return (sym.name, sym.addr - self.symbols.slide) if sym is not None else None


def hex_types(symbols: Symbols) -> bool:
    """perf's probe_type_is_available(PROBE_TYPE_X): the kernel's tracefs README lists x8/16/32/64."""
    from qprobe.kernel.tracefs import readme

    return "x8/16/32/64" in (readme(symbols) or "")


def perf_to_kprobe(probes: Sequence[PerfProbe], symbols: Symbols, arch: Arch) -> list[Translation]:
    """Each perf probe definition (``parse_perf_probe``'s, so syntax errors come before gdb starts) resolved
    from vmlinux's DWARF; one gdb for all."""
    from qprobe.paths import cache_dir

    need_dwarf(symbols.path, "a perf probe definition")
    hexa = hex_types(symbols)
    with GdbDwarf(symbols.path, cache_dir("gdb-index")) as dwarf:
        return [translate(p, dwarf, SymbolFunctions(symbols), hexa, arch.registers.pt_name) for p in probes]
