"""Loaded kernel modules, read from the live guest through drgn: text, symbols and reserved sites.

A probe on a module function needs what vmlinux gives for the kernel itself:
where the module's text is, its symbols (from the module's own kallsyms
table, as ``/proc/kallsyms`` lists them), its ``__fentry__`` sites (which
belong to the guest's ftrace), its exception-table entries (an instruction
with a fixup is not copied out of line), and its jump-label and static-call
sites and BUG()/WARN() instructions (``check_kprobe_address_safe`` refuses
those).  All of it is in
``struct module`` in guest memory; nothing comes from the module's ``.ko``.
"""

from __future__ import annotations

import drgn
from drgn.helpers.linux.kallsyms import module_kallsyms
from drgn.helpers.linux.module import for_each_module

from qprobe.kernel.symbols import ModuleText, Symbol

__all__ = ["ModuleText", "loaded_modules", "read_module"]

# enum module_state (include/linux/module.h, unchanged since Linux 3.x).
MODULE_STATE_LIVE, MODULE_STATE_COMING, MODULE_STATE_GOING, MODULE_STATE_UNFORMED = range(4)
_KINDS = {drgn.SymbolKind.FUNC: "func", drgn.SymbolKind.OBJECT: "object"}


def _text_ranges(mod: drgn.Object, init: bool = False) -> tuple[tuple[int, int], ...]:
    """The module's core text, or its init text.

    Linux 6.4 ("module: replace module_layout with module_memory", ac3b43283923)
    gave each kind of module memory its own region (``mem[MOD_TEXT]``,
    ``mem[MOD_INIT_TEXT]``); before it, text was the first ``text_size`` bytes
    of ``core_layout`` and ``init_layout``.
    """
    prog = mod.prog_
    try:
        region = mod.mem[prog.constant("MOD_INIT_TEXT" if init else "MOD_TEXT").value_()]
        base, size = region.base.value_(), region.size.value_()
    except (LookupError, AttributeError):
        layout = mod.init_layout if init else mod.core_layout
        base, size = layout.base.value_(), layout.text_size.value_()
    return ((base, base + size),) if base and size else ()


def _relative(table: drgn.Object, count: int, member: str, mask: int = 0) -> list[int]:
    """``&entry->member + entry->member`` for each entry of a table of relative (s32) entries."""
    if not count or not table.value_():
        return []
    entries = drgn.Object(table.prog_, table.prog_.array_type(table.type_.type, count), address=table.value_()).read_()
    offset = drgn.offsetof(table.type_.type, member)
    size = drgn.sizeof(table.type_.type)
    return sorted((table.value_() + i * size + offset + e.member_(member).value_()) & ~mask
                  for i, e in enumerate(entries))  # fmt: skip


def _optional(mod: drgn.Object, table: str, count: str, member: str, mask: int = 0) -> list[int]:
    """A relative table of ``struct module`` that only some configurations have (empty without it)."""
    try:
        return _relative(mod.member_(table), mod.member_(count).value_(), member, mask)
    except (LookupError, AttributeError):
        return []


def read_module(mod: drgn.Object) -> ModuleText:
    """A ``struct module *`` as a ModuleText (its symbols from its own kallsyms table).

    Its init text only while it is COMING: once it is LIVE the kernel frees that (``do_init_module``), and
    its kallsyms table is the core one, without the init symbols.
    """
    syms = sorted(
        (Symbol(s.name, s.address, s.size, _KINDS.get(s.kind, "other")) for s in module_kallsyms(mod) if s.address),
        key=lambda s: (s.addr, s.name),
    )
    try:
        sites = mod.ftrace_callsites
        n = mod.num_ftrace_callsites.value_()
        ftrace = sorted(sites[i].value_() for i in range(n)) if n and sites.value_() else []
    except AttributeError:  # no CONFIG_FTRACE_MCOUNT_RECORD: no ftrace sites to leave alone
        ftrace = []
    return ModuleText(
        name=mod.name.string_().decode(),
        struct_addr=mod.value_(),
        text=_text_ranges(mod),
        symbols=tuple(syms),
        ftrace_sites=tuple(ftrace),
        extable=frozenset(_optional(mod, "extable", "num_exentries", "insn")),
        jump_labels=tuple(_optional(mod, "jump_entries", "num_jump_entries", "code")),
        # struct static_call_site's addr keeps two flag bits (STATIC_CALL_SITE_TAIL, _INIT) in its low bits.
        static_calls=tuple(_optional(mod, "static_call_sites", "num_static_call_sites", "addr", mask=3)),
        # CONFIG_GENERIC_BUG_RELATIVE_POINTERS (x86_64): struct bug_entry starts with s32 bug_addr_disp.
        bugs=frozenset(_optional(mod, "bug_table", "num_bugs", "bug_addr_disp")),
        init_text=_text_ranges(mod, init=True) if module_state(mod) == MODULE_STATE_COMING else (),
    )


def module_state(mod: drgn.Object) -> int:
    return mod.state.value_()  # type: ignore[no-any-return]  # drgn: untyped to mypy


def loaded_modules(prog: drgn.Program) -> list[ModuleText]:
    """Every module whose text is in place (LIVE or COMING), as the kernel's ``find_module`` sees them."""
    return [read_module(m) for m in for_each_module(prog)
            if module_state(m) in (MODULE_STATE_LIVE, MODULE_STATE_COMING)]  # fmt: skip
