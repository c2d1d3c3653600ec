"""qprobe's interactive shell: perf-probe, kprobe_events and bpftrace in one REPL.

``Shell(target, out).execute(line)`` runs one command (testable without a
terminal); ``run_shell(target)`` is the prompt loop that ``qprobe shell``
and ``qprobe demo`` start.
"""

from __future__ import annotations

from .core import COMMANDS, Shell
from .prompt import SymbolIndex, run_shell

__all__ = ["COMMANDS", "Shell", "SymbolIndex", "run_shell"]
