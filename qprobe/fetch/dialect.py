"""What one kernel's kprobe_events accepts beyond 6.1's base language, and how it words its errors.

Stable kernels take backports (Debian's 6.1.192 has ``:symstr`` and spells
"Invalid $-variable specified", which 6.1.0 misspelt), so the version number
does not say what a kernel's parser does.  A :class:`Dialect` holds what the
running kernel itself says: the fetch types and fetch arguments its tracefs
``README`` lists, and the texts of its ``trace_probe_err_text`` table (a text
is there exactly when the parser has the check that logs it).
``qprobe.kernel.tracefs`` reads both from vmlinux; without them (:data:`BASE`)
the parser is 6.1.0's.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from . import messages as M
from .btf import Btf, FuncProto

# Fetch types that are not in 6.1.0 and that a kernel's README may list.
OPTIONAL_TYPES = ("symstr", "char")

# Texts a later kernel reworded beyond what a close match finds: 6.1.0's text -> the later one
# (6.12's trace_probe.h has BAD_MAXACT_TYPE where 6.1.0 has MAXACT_NO_KPROBE).
REWORDED = {M.MAXACT_NO_KPROBE: M.BAD_MAXACT_TYPE}


@dataclass(frozen=True)
class Dialect:
    """What a kernel's kprobe_events parser does beyond 6.1.0's.

    ``types``: optional fetch types the kernel accepts; ``messages``: its error
    texts (None: 6.1.0's); ``thread_size``: its THREAD_SIZE, which bounds
    ``$stackN`` and ``$argN`` (None: unknown, so those are refused);
    ``btf_args``: its README lists ``<argname>`` (CONFIG_PROBE_EVENTS_BTF_ARGS:
    function parameters by name, and ``$argN`` named after them);
    ``return_args``: its README says return probes take ``$arg<N>``;
    ``dentry_args``: its README lists the ``%pd/%pD`` types;
    ``btf``: its BTF (None: it has none); ``registers``: the names its ``%REG``
    takes (its architecture's regoffset_table, what regs_query_register_offset()
    knows: ``RegisterLayout.regoffset_table``; None: the architecture is
    unknown); ``reg_aliases``: those of them that name another pt_regs field,
    each with that field's name (arm64's ``lr``, x30).
    """

    types: frozenset[str] = frozenset()
    messages: frozenset[str] | None = None
    thread_size: int | None = None
    btf_args: bool = False
    return_args: bool = False
    dentry_args: bool = False
    btf: Btf | None = field(default=None, compare=False)
    registers: frozenset[str] | None = None
    reg_aliases: frozenset[tuple[str, str]] = frozenset()

    def proto(self, func: str | None) -> FuncProto | None:
        """``query_btf_context``: the prototype of the probed function, if BTF arguments can use it."""
        if not self.btf_args or func is None or self.btf is None:
            return None
        return self.btf.proto(func)

    def register(self, name: str) -> str | None:
        """regs_query_register_offset(): the pt_regs field ``%name`` reads, by its pt_regs name (an alias's
        field), or None if ``name`` names none; where the architecture is unknown, any name is its own."""
        if not name or (self.registers is not None and name not in self.registers):
            return None
        return dict(self.reg_aliases).get(name, name)

    def has(self, text: str) -> bool:
        """Whether the kernel's error table has this text (so it has the check that logs it)."""
        return self.messages is not None and text in self.messages

    @property
    def meta_args(self) -> bool:
        """The parser of Linux 6.5 on ("tracing/probes: Support function parameters if BTF is available").

        It checks every bare ``$arg...`` word before any argument is parsed
        (``traceprobe_expand_meta_args``), takes a word starting with a letter
        as a BTF variable, and keeps the parse offset in its parse context,
        where a dereference leaves it after its opening brace.  Known by the
        error text that series added, which a kernel without BTF has too.
        """
        return self.has(M.NOFENTRY_ARGS)

    @property
    def param_max_stack(self) -> int | None:
        """``PARAM_MAX_STACK`` (trace_probe.c): THREAD_SIZE / sizeof(unsigned long)."""
        return None if self.thread_size is None else self.thread_size // 8

    def message(self, text: str) -> str:
        """The kernel's wording of one of qprobe's (6.1.0) error texts.

        A text the kernel's table lacks is matched to the table's closest one
        (the later wording of the same error, such as a typo fix) or to its
        known rewording; a text with no match (one of qprobe's own) is kept.
        """
        if self.messages is None or text in self.messages:
            return text
        if REWORDED.get(text) in self.messages:
            return REWORDED[text]
        close = difflib.get_close_matches(text, self.messages, n=1, cutoff=0.9)
        return close[0] if close else text


# Without a kernel (a syntax check with no vmlinux at hand): 6.1.0's language, with x86_64's THREAD_SIZE
# (16 KiB without KASAN).  It knows no architecture, so %REG takes any name; a kernel's Dialect
# (qprobe.kernel.tracefs.probe_dialect: a Target's, or the CLI's from vmlinux before boot) takes its
# architecture's registers, and check_event parses a definition again in it.
BASE = Dialect(thread_size=16384)


def readme_types(readme: str) -> frozenset[str]:
    """The fetch types a tracefs README lists after ``type:`` (``s8/16/32/64`` gives s8 ... s64)."""
    m = re.search(r"^\s*type:(.*?)(?:<type>|^\s*\w+:)", readme, re.M | re.S)
    if m is None:
        return frozenset()
    out: set[str] = set()
    for word in re.split(r"[,\s]+", m.group(1)):
        first, *sizes = word.split("/")
        base = re.match(r"([a-z]+)(\d*)$", first)
        if base is None:
            continue
        out.add(first)
        if base.group(2):
            out.update(base.group(1) + s for s in sizes if s.isdigit())
    return frozenset(out)


def readme_btf_args(readme: str) -> bool:
    """``<argname>[->field...]`` among the fetch arguments: CONFIG_PROBE_EVENTS_BTF_ARGS (Linux 6.5 on)."""
    return re.search(r"^\s*<argname>", readme, re.M) is not None


def readme_return_args(readme: str) -> bool:
    """ "kernel return probes support: $retval, $arg<N>, $comm" (Linux 6.10's entry arguments in return probes)."""
    m = re.search(r"return probes support:(.*)$", readme, re.M)
    return m is not None and "$arg<N>" in m.group(1)


def readme_dentry_args(readme: str) -> bool:
    """``%pd/%pD`` among the types (6.12's README): a dentry's or a file's name, as a string."""
    m = re.search(r"^\s*type:(.*?)(?:<type>|^\s*\w+:)", readme, re.M | re.S)
    return m is not None and "%pd/%pD" in m.group(1)


def dialect_of(readme: str | None, messages: list[str] | None, thread_size: int | None = None,
               btf: Btf | None = None, registers: Mapping[str, str] | None = None) -> Dialect:  # fmt: skip
    """The Dialect of a kernel from its README text, error-text table, THREAD_SIZE and BTF (any may be unknown).

    ``registers`` is its architecture's regoffset_table: each ``%REG`` name with the pt_regs
    field it reads (None: unknown, so ``%REG`` takes any name).
    """
    types = readme_types(readme) if readme else frozenset()
    return Dialect(
        types=frozenset(t for t in OPTIONAL_TYPES if t in types),
        messages=frozenset(messages) if messages else None,
        thread_size=thread_size,
        btf_args=bool(readme) and readme_btf_args(readme or ""),
        return_args=bool(readme) and readme_return_args(readme or ""),
        dentry_args=bool(readme) and readme_dentry_args(readme or ""),
        btf=btf,
        registers=None if registers is None else frozenset(registers),
        reg_aliases=frozenset((name, pt) for name, pt in (registers or {}).items() if name != pt),
    )
