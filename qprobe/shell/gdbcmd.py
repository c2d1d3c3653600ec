"""The shell's ``gdb CMD``: a live gdb transport when the target has one, else gdb on vmlinux.

Without a live transport only commands that need nothing but the debug
information make sense; they run as ``gdb -batch -nx`` on the running
kernel's vmlinux, loaded at the KASLR slide (``symbol-file -o``) so that
addresses match the running kernel, with gdb's index cache kept in qprobe's
cache directory (the first run indexes the 590 MB vmlinux in about 20 s,
later runs take about a second).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .parse import ShellUsageError

STATIC_COMMANDS = frozenset({"ptype", "whatis", "list", "l", "disassemble", "disas", "info", "i", "print", "p",
                             "output", "macro", "explore", "help", "apropos", "show"})  # fmt: skip
STATIC_INFO = ("line", "address", "symbol", "scope", "functions", "variables", "types", "source", "sources")
LIVE_HINT = (
    "live-target gdb commands need the gdb transport, which this build does not have; "
    "on vmlinux: ptype, whatis, list, info line/address/symbol/scope, disassemble, print sizeof/&"
)
GDB_TIMEOUT = 600.0


@dataclass(frozen=True)
class GdbRun:
    stdout: str
    stderr: str
    status: int


def is_static(command: str) -> bool:
    """Can ``command`` be answered from vmlinux alone (no registers, no live memory)?"""
    words = command.split()
    if not words:
        return False
    head = words[0].split("/")[0]
    if head not in STATIC_COMMANDS:
        return False
    if head in ("info", "i"):
        return len(words) > 1 and any(s.startswith(words[1]) for s in STATIC_INFO) and len(words[1]) >= 2
    if head in ("print", "p", "output"):
        # The value of a variable in the file is its initial value, not the running one:
        # only sizes and addresses are the same in both.
        expr = command.split(None, 1)[1] if len(words) > 1 else ""
        return bool(re.match(r"\s*(sizeof\b|&)", expr))
    if head == "show":
        return len(words) > 1 and words[1] in ("version", "language", "index-cache")
    return True


def gdb_argv(vmlinux: Path, slide: int, command: str, index_dir: Path,
             sections: Iterable[tuple[str, int]] = (), gdb: str = "gdb") -> list[str]:  # fmt: skip
    """gdb on vmlinux moved by the KASLR slide: symbols (``symbol-file -o``) and file contents (``section``)."""
    argv = [
        gdb, "-batch", "-nx",
        "-iex", f"set index-cache directory {index_dir}",
        "-iex", "set index-cache enabled on",
        "-iex", "set pagination off",
        "-iex", "set width 0",
        "-ex", f"exec-file {vmlinux}",
        "-ex", f"symbol-file -o {slide:#x} {vmlinux}",
    ]  # fmt: skip
    if slide:
        for name, addr in sections:
            argv += ["-ex", f"section {name} {addr + slide:#x}"]
    return [*argv, "-ex", command]


def run_static(vmlinux: Path, slide: int, command: str, index_dir: Path,
               sections: Iterable[tuple[str, int]] = ()) -> GdbRun:  # fmt: skip
    if "\n" in command:
        raise ShellUsageError("gdb: one command per line")
    gdb = shutil.which("gdb")
    if gdb is None:
        raise ShellUsageError("gdb is not installed (Debian: apt-get install gdb)")
    argv = gdb_argv(vmlinux, slide, command, index_dir, sections, gdb)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=GDB_TIMEOUT, stdin=subprocess.DEVNULL)
    return GdbRun(proc.stdout, proc.stderr, proc.returncode)


def index_exists(index_dir: Path, build_id: str) -> bool:
    return any(index_dir.glob(f"{build_id}*"))
