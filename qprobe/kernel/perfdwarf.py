"""vmlinux's DWARF as gdb tells it, for perf probe's translation (:mod:`qprobe.kernel.perfprobe`).

:class:`GdbDwarf` is a gdb (driven through GDB/MI) with vmlinux loaded and
``perf_gdb.py`` sourced into it: it answers what libdw answers perf.  The
functions before it read gdb's words without I/O: ``info scope``'s locations
(a register, memory at a register plus an offset, a static variable, a
location list by address range) and ``maint info line-table``'s rows.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qprobe.kernel.perfsyntax import PerfProbeError

_HELPER = Path(__file__).with_name("perf_gdb.py")


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


class GdbDwarf:
    """A gdb (driven through GDB/MI) with vmlinux loaded, for :func:`qprobe.kernel.perfprobe.translate`.

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
