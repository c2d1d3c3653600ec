"""What perf and bpftrace users type for uprobes, translated into uprobe_events definitions.

Three forms, each resolved through ``resolve(path, "SYMBOL[+OFFS]") -> file
offset`` (:meth:`qprobe.kernel.userelf.UserElf.resolve` over the guest's file;
``SYMBOL@impl`` is an indirect function's implementation, as the guest's loader
picked it, where ``SYMBOL`` is its resolver, as perf and bpftrace place it):

* ``PATH:SYMBOL[+OFFS]`` in a uprobe_events line (qprobe's extension): the
  symbol becomes its file offset, the rest of the line is kept, and the line
  then goes to the kernel-faithful parser;
* ``perf probe -x PATH '[[GROUP:]EVENT=]FUNC[+OFFS|%return] [ARG...]'`` with
  fetch arguments (registers, ``$retval``, ``+OFFS(ARG)``...; perf's C variables
  need DWARF and are refused): the group is ``probe_<program>`` and the event
  ``FUNC`` or ``FUNC__return``, as perf names them (tools/perf/util/probe-event.c);
* bpftrace's ``uprobe:PATH:FUNC[+OFFS]`` / ``uretprobe:PATH:FUNC`` with the
  builtins a handler reads: ``arg0``.. (the architecture's argument registers,
  then the stack, from its :class:`~qprobe.arch.RegisterLayout`), ``retval``,
  ``comm``; ``pid`` is in every hit (the trace line's pid) and needs no argument.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from qprobe.errors import QprobeError
from qprobe.fetch.definition import Definition
from qprobe.fetch.kstrto import isdigit
from qprobe.kernel.perfsyntax import PerfProbeError, parse_perf_probe
from qprobe.kernel.userelf import IMPL, UserElf, UserFunction

if TYPE_CHECKING:
    from qprobe.arch import RegisterLayout

Resolve = Callable[[str, str], int]

PERF_GROUP = "probe"  # perf's PERFPROBE_GROUP
IFUNC_MARK = " [ifunc]"  # funcs -x's mark of an indirect function, after its name
_NAME_CHARS = re.compile(r"[^A-Za-z0-9_]")
_BPFTRACE_PROBE = re.compile(r"(uprobe|uretprobe|u|ur):(/.+):([^:/]+)")  # the function after the last ':'


class UprobeSyntaxError(QprobeError):
    """A perf, bpftrace or symbolic uprobe definition that cannot be translated; the message is one line."""


def resolve_uprobe_symbols(definition: Definition, resolve: Resolve) -> Definition:
    """``p[:EV] PATH:SYMBOL[+OFFS][%return][(REF)] ...`` with the symbol replaced by ``0x<file offset>``.

    A line whose place is already numeric (or that is not a probe on a path)
    is returned as it is, for the kernel-faithful parser to judge.
    """
    place = _symbol_place(definition)
    if place is None:
        return definition
    start, end, path = place
    offset = resolve(path, definition.words[1][1][start:end])
    return definition.replaced(1, start, end, f"0x{offset:x}")


def _symbol_place(definition: Definition) -> tuple[int, int, str] | None:
    """Where ``SYMBOL[+OFFS]`` is in a uprobe_events line's probe point word and the path before it; None if
    the line's place is numeric or the line is no probe on a path."""
    word = definition.point_word
    if word is None or definition.kind not in ("p", "r") or "/" not in word:
        return None
    colon = word.rfind(":")
    if colon < 0 or colon + 1 == len(word) or isdigit(word[colon + 1]):
        return None
    spec = word[colon + 1 :]
    cut = min((i for i in (spec.find("%"), spec.find("(")) if i >= 0), default=len(spec))
    return colon + 1, colon + 1 + cut, word[:colon]


def unresolved_syntax(definition: Definition) -> Definition:
    """The line with its ``SYMBOL[+OFFS]`` (if any) written as zeros of the same width, an octal 0: the
    kernel-faithful parser can then judge the rest of the line before the symbol can be resolved (the guest's
    file read), its carets in the columns of the line as typed."""
    place = _symbol_place(definition)
    if place is None:
        return definition
    start, end, _ = place
    return definition.replaced(1, start, end, "0" * (end - start))


def is_user_form(text: str) -> bool:
    """Whether ``text`` is perf's ``perf -x PATH ...`` or bpftrace's ``uprobe:PATH:FUNC [BUILTIN...]``."""
    words = text.split()
    return words[:2] == ["perf", "-x"] or (bool(words) and _BPFTRACE_PROBE.fullmatch(words[0]) is not None)


def user_form_definition(text: str, resolve: Resolve | None, registers: RegisterLayout) -> str:
    """A front end's ``perf -x PATH DEF`` or ``uprobe:PATH:FUNC [BUILTIN...]`` (the builtins the handler
    reads: ``arg0 comm``...) as its uprobe_events line, in the registers of the kernel's architecture.

    ``resolve`` None keeps the function as ``PATH:SYMBOL[+OFFS]`` (resolved once booted)."""
    words = text.split()
    if words[:2] == ["perf", "-x"]:
        parts = text.split(None, 3)
        if len(parts) < 4:
            raise UprobeSyntaxError("usage: perf -x PATH [[GROUP:]EVENT=]FUNC[+OFFS|%return] [ARG...]")
        return perf_uprobe_definition(parts[2], parts[3], resolve, registers)
    return bpftrace_uprobe_definition(words[0], words[1:], resolve, registers)


def symbolic_user_form(text: str, registers: RegisterLayout) -> str:
    """A perf ``-x`` or bpftrace ``uprobe:`` form as its uprobe_events line with ``PATH:SYMBOL`` (resolved once
    booted), for the checks before boot."""
    return user_form_definition(text, None, registers)


def _file_point(path: str, spec: str, resolve: Resolve | None) -> str:
    """``PATH:0xOFFSET``, ``spec``'s file offset; ``PATH:SPEC`` without ``resolve``."""
    return f"{path}:{spec}" if resolve is None else f"{path}:0x{resolve(path, spec):x}"


def perf_uprobe_definition(path: str, text: str, resolve: Resolve | None, registers: RegisterLayout) -> str:
    """``perf probe -x PATH TEXT`` as the uprobe_events line perf would write (``registers``: the
    architecture's, which the refusal of a C variable suggests instead)."""
    try:
        probe = parse_perf_probe(text)
    except PerfProbeError as exc:
        raise UprobeSyntaxError(str(exc)) from None
    impl = probe.file == IMPL[1:]  # perf's FUNC@SRC with "impl" for SRC: FUNC@impl, as the other forms write it
    if probe.function is None or (probe.file and not impl) or probe.line is not None or probe.lazy is not None:
        raise UprobeSyntaxError(f"{text.strip()}: a uprobe is placed on FUNC or FUNC+OFFS (lines need DWARF)")
    for arg in probe.args:
        if arg.is_c_var or arg.fields:
            first, second = registers.arg_regs[:2]
            raise UprobeSyntaxError(f"{arg.text}: C variables need the program's DWARF; fetch registers "
                                    f"(%{first}, %{second}...) or memory (+0(%{first}):string) instead")  # fmt: skip
    function = probe.function + (IMPL if impl else "")
    point = _file_point(path, f"{function}+{probe.offset}" if probe.offset else function, resolve)
    group = probe.group or f"{PERF_GROUP}_{_program_name(path)}"
    event = probe.event or _event_name(function) + ("__return" if probe.is_return else "")
    head = f"{'r' if probe.is_return else 'p'}:{group}/{event}"
    args = [(f"{a.name}=" if a.name else "") + a.var + (f":{a.type}" if a.type else "") for a in probe.args]
    return " ".join([head, point, *args])


def bpftrace_uprobe_definition(probe: str, variables: Sequence[str], resolve: Resolve | None,
                               registers: RegisterLayout) -> str:  # fmt: skip
    """``uprobe:PATH:FUNC[+OFFS]`` / ``uretprobe:PATH:FUNC`` fetching the bpftrace builtins in ``variables``.

    Each builtin becomes an argument of its own name (``arg0=%di:u64`` on
    x86_64, ``retval=$retval:u64``, ``comm=$comm``); ``pid`` adds none.
    bpftrace's own checks are kept: ``argN`` only in a uprobe, ``retval`` only
    in a uretprobe.  ``argN`` is the function's integer argument N at its entry
    by ``registers``, the kernel's architecture's: a user program passes
    arguments as its kernel does (x86_64's SysV ABI, arm64's AAPCS64).
    """
    m = _BPFTRACE_PROBE.fullmatch(probe.strip())
    if m is None:
        raise UprobeSyntaxError(f"{probe!r}: expected uprobe:PATH:FUNC or uretprobe:PATH:FUNC")
    kind, path, func = m.groups()
    is_return = kind in ("uretprobe", "ur")
    if is_return and "+" in func:
        raise UprobeSyntaxError(f"{probe}: a uretprobe is on a function's entry, not FUNC+OFFS")
    point = _file_point(path, func, resolve)
    args: list[str] = []
    for var in dict.fromkeys(variables):
        arg = re.fullmatch(r"arg(\d+)", var)
        if arg:
            if is_return:
                raise UprobeSyntaxError(f"{var}: bpftrace reads arguments in uprobes, not in uretprobes")
            args.append(f"{var}={_argument(int(arg.group(1)), registers)}:u64")
        elif var == "retval":
            if not is_return:
                raise UprobeSyntaxError("retval: bpftrace has it in uretprobes only")
            args.append("retval=$retval:u64")
        elif var == "comm":
            args.append("comm=$comm")
        elif var != "pid":
            raise UprobeSyntaxError(f"{var}: a uprobe fetches arg0.., retval, comm and pid")
    event = _event_name(func.split("+", 1)[0]) + ("__return" if is_return else "")
    head = f"{'r' if is_return else 'p'}:uprobes/{event}"
    return " ".join([head, point, *args])


def _argument(n: int, registers: RegisterLayout) -> str:
    """The fetch argument of integer argument ``n`` (0-based) at a function's entry: its register, or the
    stack, where the arguments past the registers are 8-byte words from ``sp + stack_args`` up."""
    regs = registers.arg_regs
    if n < len(regs):
        return f"%{regs[n]}"
    return f"+{registers.stack_args + 8 * (n - len(regs))}(%{registers.sp})"


def _program_name(path: str) -> str:
    """perf's convert_exec_to_group: the file's name up to its first ``-``, ``.`` or ``_``."""
    base = path.rstrip("/").rsplit("/", 1)[-1]
    return re.split(r"[-._]", base, maxsplit=1)[0]


def _event_name(func: str) -> str:
    return _NAME_CHARS.sub("_", func)


def render_user_funcs(elf: UserElf, path: str, patterns: Sequence[str]) -> tuple[str, str, int]:
    """``funcs -x``: (one line per matching function: file offset, size, name; a summary line; how many matched).

    The offset is what ``PATH:0xOFFSET`` probes (the same place as ``PATH:NAME``).  An indirect function
    (STT_GNU_IFUNC) is marked ``[ifunc]``: its offset is its resolver's, ``NAME@impl`` the implementation's.
    """
    found: dict[tuple[int, str], UserFunction] = {}
    for pattern in patterns or ["*"]:
        for f in elf.functions(pattern):
            found.setdefault((f.offset, f.name), f)
    rows = sorted(found.values(), key=lambda f: (f.offset, f.name))
    lines = "".join(f"0x{f.offset:08x} {f.size:8d} {f.name}{IFUNC_MARK if f.ifunc else ''}\n" for f in rows)
    what = " ".join(repr(p) for p in patterns) if patterns else "any name"
    if not rows:
        return "", f"no function of {path} matches {what}", 0
    plural = "s match" if len(rows) > 1 else " matches"
    summary = f"{len(rows)} function{plural} {what} in {path} (file offset, size, name)"
    if any(f.ifunc for f in rows):
        summary += f";{IFUNC_MARK}: an indirect function, at its resolver (NAME{IMPL}: the implementation picked)"
    return lines, summary, len(rows)
