"""The kprobe_events language of Linux 6.1, parsed and evaluated on the host.

The guest kernel never sees these definitions: qprobe parses them exactly as
``kernel/trace/trace_kprobe.c`` would (same acceptance, same error_log texts
and caret columns), evaluates the fetch arguments against a stopped guest
through a :class:`FetchContext`, and prints what ftrace would print.
"""

from __future__ import annotations

from .args import FetchArg, Value
from .context import FAULT, REGISTERS, Fault, FetchContext, MemoryFault, SymbolValue
from .event import DeleteEvent, ProbeEvent, check_append, check_event, parse_event, parse_events
from .expr import Arg, Comm, Deref, Imm, ImmString, Node, Reg, RetVal, Stack, StackPointer, SymbolAddr
from .ftypes import Bitfield, FetchType
from .output import SymbolInfo, format_event, format_hit, print_fmt, print_ip_sym, sprint_symbol, terminal_safe

__all__ = [
    "FAULT",
    "REGISTERS",
    "Arg",
    "Bitfield",
    "Comm",
    "DeleteEvent",
    "Deref",
    "Fault",
    "FetchArg",
    "FetchContext",
    "FetchType",
    "Imm",
    "ImmString",
    "MemoryFault",
    "Node",
    "ProbeEvent",
    "Reg",
    "RetVal",
    "Stack",
    "StackPointer",
    "SymbolAddr",
    "SymbolInfo",
    "SymbolValue",
    "Value",
    "check_append",
    "check_event",
    "format_event",
    "format_hit",
    "parse_event",
    "parse_events",
    "print_fmt",
    "print_ip_sym",
    "sprint_symbol",
    "terminal_safe",
]
