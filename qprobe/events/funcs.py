"""Which kernel functions qprobe can probe, and the names a typo was meant to be, from vmlinux.

``Probeability`` answers, for a function name, why a kprobe event on its entry
would be refused, with the checks the kernel's own event code makes in the
order it makes them: a name kallsyms has several times (``validate_probe_symbol``),
text freed after boot, a function ftrace cannot trace (``within_notrace_func``),
the kprobe blacklist (``within_kprobe_blacklist``) and run-time-patched sites
(``check_kprobe_address_safe``).  Each check is the one the core uses when it
registers a probe; this module only puts them in one place so that the host
can answer before a VM is booted (``Probeability.of(symbols, arch)``), and a running
target with its own tables (``Probeability.of_target``).
"""

from __future__ import annotations

import bisect
import difflib
import fnmatch
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from qprobe.arch import Arch
from qprobe.core.blacklist import Blacklist
from qprobe.errors import FetchArgError, SymbolError
from qprobe.fetch import messages as M
from qprobe.fetch.definition import Definition, is_glob
from qprobe.fetch.dialect import Dialect
from qprobe.kernel.reserved import ReservedText
from qprobe.kernel.symbols import ModuleText, Symbols
from qprobe.kernel.tracefs import ftrace_locations, probe_dialect, within_notrace_func

__all__ = [
    "Func",
    "Probeability",
    "check_probe_symbol",
    "did_you_mean",
    "is_glob",
    "render_funcs",
    "suggest",
    "unknown_symbol",
    "wildcard_definitions",
]


class Sites(Protocol):
    """What of_target reads of where probes may go (qprobe.core.sites.ProbeSites)."""

    blacklist: Blacklist

    @property
    def reserved(self) -> ReservedText | None: ...


class ProbeTables(Protocol):
    """What of_target reads of a running target's probe table (qprobe.core.kprobes.KprobeManager)."""

    @property
    def sites(self) -> Sites: ...


class LoadedModules(Protocol):
    """The guest's modules as a running target knows them (qprobe.events.modules.ModuleNotifier)."""

    def loaded(self) -> list[ModuleText]: ...


class KernelFacts(Protocol):
    """What of_sites reads of a running kernel (qprobe.api.Target, qprobe.events.define.EventRegistry)."""

    symbols: Symbols

    @property
    def ftrace_locations(self) -> list[int]: ...
    @property
    def dialect(self) -> Dialect: ...
    @property
    def modules(self) -> LoadedModules: ...


class RunningTarget(KernelFacts, Protocol):
    """What of_target reads of a running target (qprobe.api.Target)."""

    @property  # read-only, so that the target's KprobeManager implements it
    def kprobes(self) -> ProbeTables: ...


# GCC's names for copies of a function: foo.isra.0, foo.constprop.0, foo.part.0, foo.cold, foo.lto_priv.0
_CLONE = re.compile(r"^(?P<base>[^.]+)\.")


@dataclass(frozen=True)
class Func:
    """A kernel function, and why qprobe cannot probe its entry (None when it can)."""

    name: str
    addr: int
    size: int
    reason: str | None
    module: str | None = None  # a loaded module's function

    @property
    def probeable(self) -> bool:
        return self.reason is None

    @property
    def label(self) -> str:
        """The name as /proc/kallsyms and available_filter_functions list it: ``name [module]`` for a module's."""
        return self.name if self.module is None else f"{self.name} [{self.module}]"


class Probeability:
    """The refusals of one kernel's probe code, for function entries."""

    def __init__(self, symbols: Symbols, blacklist: Blacklist, locations: list[int],
                 reserved: ReservedText | None, dialect: Dialect,
                 modules: Sequence[ModuleText] = ()) -> None:  # fmt: skip
        # With stub breakpoints (qprobe.core.anywhere) nothing is written into the text, so what the kernel
        # refuses for its own int3 (notrace, the blacklist, sites it rewrites) is probed too.
        self.anywhere = False
        self.symbols = symbols
        self.modules = modules  # the running guest's loaded modules (none before a boot)
        self._module_copies = Counter(s.name for m in modules for s in m.symbols if s.kind == "func")
        # Kernels with validate_probe_symbol refuse a shared name; older ones probe the first of them.
        self.unique_names = dialect.has(M.NON_UNIQ_SYMBOL)
        self.blacklist = blacklist
        self.locations = locations
        self.reserved = reserved
        self._functions: list[str] | None = None
        self._copies: dict[str, int] = {}  # function name -> how many functions (distinct addresses) have it

    @classmethod
    def of(cls, symbols: Symbols, arch: Arch) -> Probeability:
        """From the vmlinux file alone, before anything boots (reserved sites as the file has them)."""
        # The BUG table's entry size needs the kernel's types; a function's entry is never a BUG site.
        reserved = ReservedText(symbols, symbols.file_bytes, None, arch)
        blacklist = Blacklist(symbols, arch.arch_populate_kprobe_blacklist())
        dialect = probe_dialect(symbols, arch.registers.regoffset_table)
        return cls(symbols, blacklist, ftrace_locations(symbols), reserved, dialect)

    @classmethod
    def of_target(cls, target: RunningTarget) -> Probeability:
        """With a running target's tables (its slide, its reserved sites as the text is now)."""
        return cls.of_sites(target, target.kprobes.sites)

    @classmethod
    def of_sites(cls, kernel: KernelFacts, sites: Sites) -> Probeability:
        """With a running kernel's facts and the probe sites of its probe table."""
        return cls(kernel.symbols, sites.blacklist, kernel.ftrace_locations, sites.reserved, kernel.dialect,
                   kernel.modules.loaded())  # fmt: skip

    def functions(self) -> list[str]:
        """Every function name of the symbol table, each once, sorted."""
        if self._functions is None:
            addrs: dict[str, set[int]] = {}
            for sym in self.symbols.functions_in(0, 1 << 64):
                if sym.size:
                    addrs.setdefault(sym.name, set()).add(sym.addr)
            self._copies = {name: len(at) for name, at in addrs.items()}
            self._functions = sorted(addrs)
        return self._functions

    def reason(self, name: str) -> str | None:
        """Why a kprobe event on ``name``'s entry would be refused, or None."""
        symbols = self.symbols
        if name not in symbols:
            return "not in the symbol table"
        self.functions()
        # Symbols.count scans the whole table; only a name two functions share needs its answer.
        count = symbols.count(name) if self.unique_names and self._copies.get(name, 1) > 1 else 1
        count += self._module_copies.get(name, 0) if self.unique_names else 0  # kallsyms searches modules too
        if count > 1:
            return f"not unique: {count} functions share the name (probe one by address)"
        addr = symbols.address(name)
        if not symbols.is_text(addr):
            section = symbols.section_at(addr)
            return f"in {section.name if section else 'no section'}, not kernel text after boot"
        return None if self.anywhere else self._kprobes_refusal(addr)

    def anywhere_only(self, name: str) -> bool:
        """Whether ``name``'s entry is refused only for the kernel's int3, and a stub breakpoint takes it."""
        if self.anywhere or name not in self.symbols or self.reason(name) is None:
            return False
        self.anywhere = True
        try:
            return self.reason(name) is None
        finally:
            self.anywhere = False

    def _kprobes_refusal(self, addr: int) -> str | None:
        """What the kernel's kprobes refuse at ``addr`` for their int3, which a stub breakpoint does not write."""
        if within_notrace_func(self.symbols, self.locations, addr):
            return "notrace: no __fentry__ site, the kernel refuses kprobe events there"
        bad = self.blacklist.lookup(addr)
        if bad is not None:
            return f"blacklisted ({bad.name})"
        if self.reserved is not None:
            site = self.reserved.conflict(addr, addr)
            if site is not None:
                return f"reserved ({site}): the kernel rewrites it at run time"
        return None

    def module_reason(self, mod: ModuleText, name: str, addr: int) -> str | None:
        """``reason`` for a loaded module's function (its own ``__mcount_loc``, its own symbols)."""
        if self.unique_names:
            self.functions()
            count = self._module_copies[name] + self._copies.get(name, 0)
            if count > 1:
                return f"not unique: {count} functions share the name (probe MOD:SYM or one by address)"
        if not mod.is_text(addr):
            return "not in the module's text (its init text is freed once it is loaded)"
        if mod.ftrace_sites and self._module_notrace(mod, name, addr):
            return "notrace: no __fentry__ site, the kernel refuses kprobe events there"
        if self.reserved is not None:
            site = self.reserved.conflict(addr, addr)
            if site is not None:
                return f"reserved ({site}): the kernel rewrites it at run time"
        return None

    @staticmethod
    def _module_notrace(mod: ModuleText, name: str, addr: int) -> bool:
        """within_notrace_func in a module: no ftrace site up to the next symbol; a GCC copy judged by its base."""

        def notrace(a: int) -> bool:
            end = mod.next_symbol(a) or a + 1
            i = bisect.bisect_left(mod.ftrace_sites, a)
            return not (i < len(mod.ftrace_sites) and mod.ftrace_sites[i] < end)

        if not notrace(addr):
            return False
        base = mod.lookup(name.split(".", 1)[0]) if "." in name else []
        return not base or notrace(base[0].addr)

    def module_functions(self) -> list[tuple[ModuleText, str, int, int]]:
        """(module, name, address, size) of every function of the loaded modules, in their order."""
        return [(m, s.name, s.addr, s.size) for m in self.modules for s in m.symbols if s.kind == "func"]

    def match(self, patterns: Sequence[str]) -> list[Func]:
        """The functions matching any of ``patterns`` (globs or names), sorted by name: vmlinux's, then modules'."""
        names = self.functions()
        chosen: set[str] = set()
        for pat in patterns:
            if is_glob(pat):
                chosen.update(fnmatch.filter(names, pat))
            elif self._in_vmlinux(pat):
                chosen.add(pat)
        out = []
        for name in sorted(chosen):
            sym = self.symbols.lookup(name)
            out.append(Func(name, sym.addr, sym.size, self.reason(name)))
        mods = []
        for mod, name, addr, size in self.module_functions():
            if any(fnmatch.fnmatchcase(name, pat) or pat == f"{mod.name}:{name}" for pat in patterns):
                mods.append(Func(name, addr, size, self.module_reason(mod, name, addr), mod.name))
        return out + sorted(mods, key=lambda f: (f.name, f.module or ""))

    def _in_vmlinux(self, name: str) -> bool:
        """Whether vmlinux has the symbol ``name`` (the symbol table also answers for modules it follows)."""
        return name in self.symbols and self.symbols.module_of(self.symbols.lookup(name).addr) is None

    def known(self, name: str) -> bool:
        """Whether ``name`` (or ``MOD:NAME``) is a symbol of vmlinux or a function of a loaded module."""
        return self._in_vmlinux(name) or any(name in (n, f"{m.name}:{n}") for m, n, _a, _s in self.module_functions())


def suggest(names: Iterable[str], name: str, n: int = 3) -> list[str]:
    """The names ``name`` was probably meant to be: its GCC copies first, then the closest spellings."""
    pool = list(names)
    base = _CLONE.match(name)
    stem = base.group("base") if base else name
    copies = sorted(x for x in pool if x != name and (x.startswith(stem + ".") or x == stem))
    # difflib's ratio over every name costs seconds; names far longer or shorter cannot be close anyway.
    slack = max(3, len(name) // 3)
    near = [x for x in pool if abs(len(x) - len(name)) <= slack]
    close = difflib.get_close_matches(name, near, n=n, cutoff=0.75)
    out = copies[:n]
    out += [x for x in close if x not in out]
    return out[:n]


def unknown_symbol(symbols: Symbols, name: str, names: Iterable[str] | None = None) -> SymbolError:
    """``no function NAME in VMLINUX (did you mean ...?)``, one line."""
    hint = did_you_mean(symbols.names() if names is None else names, name)
    return SymbolError(f"no symbol {name!r} in {symbols.path.name}{hint}")


def did_you_mean(names: Iterable[str], name: str) -> str:
    """`` (did you mean a, b?)`` with the names ``suggest`` finds, or ""."""
    close = suggest(names, name)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def check_probe_symbol(prob: Probeability, symbol: str, offset: int = 0) -> list[Func]:
    """Refuse, in one line, a probe symbol the kernel would refuse; the matches of a glob.

    An unknown name suggests the closest ones; a function's entry that cannot be
    probed says why; a glob must match at least one function that can be.
    """
    if is_glob(symbol):
        found = prob.match([symbol])
        if not found:
            raise SymbolError(f"no function matches {symbol!r}")
        if not any(f.probeable for f in found):
            first = found[0]
            raise SymbolError(f"none of the {len(found)} functions matching {symbol!r} can be probed "
                              f"({first.name}: {first.reason})")  # fmt: skip
        return found
    if ":" in symbol:
        return []  # MOD:SYM: the module's symbols are the running guest's (a module not loaded yet waits)
    if symbol not in prob.symbols:
        raise unknown_symbol(prob.symbols, symbol, prob.functions())
    if offset == 0:
        why = prob.reason(symbol)
        if why is not None:
            raise SymbolError(f"cannot probe {symbol}: {why}")
    return []


def render_funcs(prob: Probeability, patterns: Sequence[str]) -> tuple[str, str, int]:
    """(one line per matching function, a summary line, how many matched).

    A function qprobe can probe is its bare name (as ``perf probe -F`` lists them,
    so the output pipes into other tools); one it cannot is followed by why.
    """
    found = prob.match(patterns or ["*"])
    width = max((len(f.label) for f in found if not f.probeable), default=0)
    lines = [f.label if f.probeable else f"{f.label:<{width}}  cannot probe: {f.reason}"
             + (" (--anywhere: a stub breakpoint)" if prob.anywhere_only(f.name) else "") for f in found]  # fmt: skip
    what = " ".join(repr(p) for p in patterns) if patterns else "any name"
    missing = [p for p in patterns if not is_glob(p) and not prob.known(p)]
    hints = "".join(f"; no function {p!r}{did_you_mean(prob.functions(), p)}" for p in missing)
    if not found:
        return "", f"no function matches {what}{hints}", 0
    refused = sum(not f.probeable for f in found)
    plural = "s match" if len(found) > 1 else " matches"
    summary = f"{len(found)} function{plural} {what}: {len(found) - refused} can be probed, {refused} cannot{hints}"
    return "".join(line + "\n" for line in lines), summary, len(found)


def wildcard_definitions(definition: Definition, names: Sequence[str]) -> list[tuple[str, Definition]]:
    """``(function, definition)`` for each of ``names``: ``definition`` with its glob replaced (its words
    rewritten, not its text parsed again).

    ``p:NAME GLOB ARGS`` (or ``p:GRP/ GLOB``) becomes ``p:NAME/FUNC FUNC ARGS`` for each
    function: the name becomes the group and each event is named after its function
    (``.`` made ``_``, as the kernel's default names do), so hits say which function
    they came from, as bpftrace's ``func`` does.  Without a name the kernel's default
    names (``p_FUNC_0``) apply in its ``kprobes`` group.  ``p:GRP/NAME GLOB`` is refused:
    one name cannot be many events.
    """
    text, words = definition.text, definition.words
    if len(words) < 2:
        raise FetchArgError(M.NO_PROBE_POINT, text, 0)
    head, point = definition.head, words[1][1]
    m = re.fullmatch(r"([pr]\d*)(?::(.*))?", head)
    if m is None:
        raise FetchArgError(M.NOT_A_PROBE, text, 0)
    kind, name = m.group(1), m.group(2)
    group: str | None = None
    if name is not None:
        grp, sep, event = name.replace(".", "/", 1).partition("/")
        if sep and event:
            raise FetchArgError("A wildcard probe makes one event per function: name a group (p:GRP/) or p:NAME",
                                text, words[0][0] + len(m.group(1)) + 1)  # fmt: skip
        group = grp
    glob_end = len(re.match(r"[^+%]*", point).group(0))  # type: ignore[union-attr]
    out = []
    seen: set[str] = set()
    for func in names:
        if group is None:
            out.append((func, definition.with_point(kind, func, glob_end)))
            continue
        event = func.replace(".", "_")[: M.MAX_EVENT_NAME_LEN - 1]
        if event in seen:  # foo.part.0 and foo_part_0: the first keeps the name
            continue
        seen.add(event)
        out.append((func, definition.with_point(f"{kind}:{group}/{event}", func, glob_end)))
    return out
