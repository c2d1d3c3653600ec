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
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from qprobe.arch import Arch
from qprobe.errors import QprobeError
from qprobe.kernel.debuginfo import need_dwarf

if TYPE_CHECKING:
    from qprobe.kernel.symbols import Symbols

PERF_PREFIX = "perf"
DEFAULT_GROUP = "probe"  # perf's PERFPROBE_GROUP
MAX_BASIC_TYPE_BITS = 64
_C_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HELPER = Path(__file__).with_name("perf_gdb.py")


class PerfProbeError(QprobeError):
    """A perf probe definition that cannot be parsed or resolved; the message is one line."""


# -- the language ---------------------------------------------------------------------------
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


# -- gdb's words -> fetch arguments (pure) -----------------------------------------------------
@dataclass(frozen=True)
class Location:
    """Where a variable is at one address: ``%reg`` (``offset`` None) or memory at ``offset(%reg)``/``@sym``."""

    base: str
    offset: int | None = None

    def refs(self) -> list[int]:
        return [] if self.offset is None else [self.offset]


_SYMBOL = re.compile(r"^Symbol (\S+) is (.*)$")
_RANGE = re.compile(r"Range (0x[0-9a-f]+)-(0x[0-9a-f]+): (.*)$")


def parse_scope(text: str) -> dict[str, str | list[tuple[int, int, str]]]:
    """``info scope``'s output: each symbol's one location, or its location list as (lo, hi, description).

    The first (innermost) symbol of a name wins, as perf's search of the scope does.
    """
    out: dict[str, str | list[tuple[int, int, str]]] = {}
    name: str | None = None
    ranges: list[tuple[int, int, str]] = []
    for line in text.splitlines():
        m = _SYMBOL.match(line)
        if m:
            name, desc = m.group(1), m.group(2)
            if desc.startswith("multi-location"):
                ranges = []
                out.setdefault(name, ranges)
            else:
                out.setdefault(name, re.sub(r", length \d+\.$", "", desc).removesuffix("."))
            continue
        r = _RANGE.search(line)
        if r and name is not None:
            ranges.append((int(r.group(1), 16), int(r.group(2), 16), r.group(3).strip()))
        elif ranges and line.strip() and not line.startswith(","):
            lo, hi, desc = ranges[-1]
            ranges[-1] = (lo, hi, f"{desc} {line.strip()}")
    return out


def location_at(entry: str | list[tuple[int, int, str]], addr: int) -> str | None:
    """The description that holds at ``addr`` (None: the location list does not cover it)."""
    if isinstance(entry, str):
        return entry
    for lo, hi, desc in entry:
        if lo <= addr < hi:
            return desc
    return None


def first_covered(entry: str | list[tuple[int, int, str]], start: int, end: int) -> str | None:
    """perf's rule for a parameter at the function's entry: the first location the list gives in the function."""
    if isinstance(entry, str):
        return entry
    for lo, hi, desc in sorted(entry):
        if hi > start and lo < end:
            return desc
    return None


def _reg(gdb_name: str, var: str, pt_name: Mapping[str, str]) -> str:
    if gdb_name not in pt_name:
        raise PerfProbeError(f"{var} is in ${gdb_name}, which kprobe_events cannot fetch")
    return f"%{pt_name[gdb_name]}"


def parse_location(desc: str, var: str, pt_name: Mapping[str, str]) -> Location:
    """gdb's description of a location (``a variable in $rdx``...) as perf's fetch base.

    ``pt_name`` maps gdb's register names to pt_regs names (the arch's ``RegisterLayout.pt_name``).
    """
    if m := re.fullmatch(r"a variable in \$(\w+)", desc):
        return Location(_reg(m.group(1), var, pt_name))
    if m := re.fullmatch(r"a variable at offset (-?\d+) from base reg \$(\w+)", desc):
        return Location(_reg(m.group(2), var, pt_name), int(m.group(1)))
    if m := re.fullmatch(r"a variable at frame base reg \$(\w+) offset (-?\d+)\+(-?\d+)", desc):
        return Location(_reg(m.group(1), var, pt_name), int(m.group(2)) + int(m.group(3)))
    if m := re.fullmatch(r"static storage at address (0x[0-9a-f]+)", desc):
        return Location(f"@{var}", 0)
    if desc.startswith("optimized out"):
        raise PerfProbeError(f"{var} is optimized out")
    if desc.startswith("constant"):
        raise PerfProbeError(f"{var} is a constant ({desc}), not in a register or memory")
    if desc.startswith("a complex DWARF expression"):
        ops = re.findall(r"DW_OP_\w+", desc)
        raise PerfProbeError(f"{var} is computed here ({' '.join(ops[:4])}{' ...' if len(ops) > 4 else ''}); "
                             "perf fetches only registers and memory at register offsets")  # fmt: skip
    raise PerfProbeError(f"{var}: a location perf cannot fetch ({desc})")


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


def parse_line_table(text: str) -> list[tuple[str, list[tuple[int, int, bool]]]]:
    """``maint info line-table``: per symtab, its (line, address, is_stmt) rows; END rows are skipped."""
    tables: list[tuple[str, list[tuple[int, int, bool]]]] = []
    for line in text.splitlines():
        if line.startswith("symtab: "):
            tables.append((line.split()[1], []))
            continue
        m = re.match(r"\s*\d+\s+(\d+)\s+(0x[0-9a-f]+)\s*(Y?)", line)
        if m and tables:
            tables[-1][1].append((int(m.group(1)), int(m.group(2), 16), m.group(3) == "Y"))
    return tables


def line_address(rows: Sequence[tuple[int, int, bool]], line: int, lo: int = 0, hi: int = 1 << 64) -> int | None:
    """The first is_stmt address of ``line`` within [lo, hi), as perf's line walker finds it."""
    found = [addr for ln, addr, stmt in rows if ln == line and stmt and lo <= addr < hi]
    return min(found) if found else None


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
class GdbDwarf:
    """A gdb (driven through GDB/MI) with vmlinux loaded, for :func:`translate`.

    gdb's index cache in ``index_dir`` makes the load about a second once it holds
    this build (the shell's ``gdb`` and the live target's gdb share it).
    """

    def __init__(self, vmlinux: str | Path, index_dir: str | Path) -> None:
        from qprobe.vmm.gdbmi_channel import MiChannel
        from qprobe.vmm.gdbmi_parse import mi_quote

        self._quote = mi_quote
        self.conn = MiChannel(name="vmlinux")
        try:
            for cmd in ("set pagination off", "set width 0", f"set index-cache directory {index_dir}",
                        "set index-cache enabled on"):  # fmt: skip
                self.cli(cmd)
            self.cli(f"file {vmlinux}", timeout=600.0)
            self.cli(f"source {_HELPER}")
        except BaseException:
            self.conn.close()
            raise

    def cli(self, command: str, timeout: float = 120.0) -> str:
        from qprobe.errors import TargetError
        from qprobe.vmm.gdbmi_parse import result_payload

        record = self.conn.result(self.conn.send(f"-interpreter-exec console {self._quote(command)}"), command,
                                  timeout)  # fmt: skip
        text = self.conn.console_text()
        try:
            result_payload(record, repr(command))
        except TargetError as exc:
            raise PerfProbeError(str(exc)) from None
        return text

    def _py(self, call: str) -> Any:
        return json.loads(self.cli(f"python {call}").strip().splitlines()[-1])

    def function(self, name: str) -> dict[str, Any] | None:
        return self._py(f"qp_function({name!r})")  # type: ignore[no-any-return]

    def symtab_files(self, spec: str) -> list[str]:
        found = self._py(f"qp_symtab({spec!r})")
        if "error" in found:
            raise PerfProbeError(f"{spec}: {found['error']}")
        return found["files"]  # type: ignore[no-any-return]

    def line_table(self, file: str) -> list[tuple[int, int, bool]]:
        self.cli(f"info line {file}:1")  # expands the file's symtab: maint lists expanded ones only
        text = self.cli(f"maint info line-table {re.escape(file)}$")
        # gdb's symtab names carry the build directory ("debian/build/.../fs/read_write.c").
        return [row for name, table in parse_line_table(text) if name == file or name.endswith(f"/{file}")
                for row in table]  # fmt: skip

    def scope(self, addr: int) -> str:
        return self.cli(f"info scope *{addr:#x}")

    def access(self, var: str, addr: int, fields: Sequence[tuple[str, str]]) -> dict[str, Any]:
        return self._py(f"qp_access({var!r}, {addr}, {json.dumps([list(f) for f in fields])})")  # type: ignore[no-any-return]

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> GdbDwarf:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def perf_to_kprobe(texts: Sequence[str], symbols: Symbols, arch: Arch) -> list[Translation]:
    """Each perf probe definition in ``texts`` (``perf ...``) resolved from vmlinux's DWARF; one gdb for all."""
    from qprobe.paths import cache_dir

    probes = [parse_perf_probe(t) for t in texts]  # syntax errors before gdb starts
    need_dwarf(symbols.path, "a perf probe definition")
    hexa = hex_types(symbols)
    with GdbDwarf(symbols.path, cache_dir("gdb-index")) as dwarf:
        return [translate(p, dwarf, SymbolFunctions(symbols), hexa, arch.registers.pt_name) for p in probes]
