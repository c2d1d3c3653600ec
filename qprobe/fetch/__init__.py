"""The kprobe_events language of Linux 6.1, parsed and evaluated on the host.

The guest kernel never sees these definitions: qprobe parses them exactly as
``kernel/trace/trace_kprobe.c`` would (same acceptance, same error_log texts
and caret columns), evaluates the fetch arguments against a stopped guest
through a :class:`FetchContext`, and prints what ftrace would print.
"""

from __future__ import annotations

from .args import FetchArg, Value
from .context import FAULT, Fault, FetchContext, MemoryFault, SymbolValue, UprobeContext, UserFetchContext
from .definition import Address, Definition, FilePoint, Glob, Point, Symbol, is_glob, parse_definition
from .event import DeleteEvent, ProbeEvent, check_append, check_event, parse_event, parse_events
from .expr import Arg, Comm, Deref, FileOffset, Imm, ImmString, Node, Reg, RetVal, Stack, StackPointer, SymbolAddr
from .ftypes import Bitfield, FetchType
from .output import (
    SymbolInfo,
    format_event,
    format_hit,
    format_uprobe_event,
    format_uprobe_hit,
    format_uprobe_profile,
    print_fmt,
    print_ip_sym,
    sprint_symbol,
    terminal_safe,
)
from .uevent import UprobeEvent, check_uprobe_append, parse_uprobe_event, parse_uprobe_events

__all__ = [
    "FAULT",
    "Address",
    "Arg",
    "Bitfield",
    "Comm",
    "Definition",
    "DeleteEvent",
    "Deref",
    "Fault",
    "FetchArg",
    "FetchContext",
    "FetchType",
    "FileOffset",
    "FilePoint",
    "Glob",
    "Imm",
    "ImmString",
    "MemoryFault",
    "Node",
    "Point",
    "ProbeEvent",
    "Reg",
    "RetVal",
    "Stack",
    "StackPointer",
    "Symbol",
    "SymbolAddr",
    "SymbolInfo",
    "SymbolValue",
    "UprobeContext",
    "UprobeEvent",
    "UserFetchContext",
    "Value",
    "check_append",
    "check_event",
    "check_uprobe_append",
    "format_event",
    "format_hit",
    "format_uprobe_event",
    "format_uprobe_hit",
    "format_uprobe_profile",
    "is_glob",
    "parse_definition",
    "parse_event",
    "parse_events",
    "parse_uprobe_event",
    "parse_uprobe_events",
    "print_fmt",
    "print_ip_sym",
    "sprint_symbol",
    "terminal_safe",
]
