"""Runs inside gdb (``source``d by :class:`qprobe.kernel.perfdwarf.GdbDwarf`), never imported by qprobe.

gdb's Python API over vmlinux's DWARF answers what perf probe asks libdw:
a function's declaration line and file, and the type walk of ``var->a.b[2]``
(member offsets, dereferences, the final type).  Each ``qp_*`` prints one line
of JSON; variable *locations* are not in gdb's Python API and come from
``info scope`` instead.
"""

from __future__ import annotations

import json

import gdb  # type: ignore[import-untyped]  # gdb's own module, only inside gdb; no stubs installed


def _say(value: object) -> None:
    print(json.dumps(value))


def _real(t: gdb.Type) -> gdb.Type:
    """The type with typedefs and const/volatile removed (libdw's die_get_real_type)."""
    while True:
        r = t.strip_typedefs().unqualified()
        if r == t:
            return r
        t = r


def qp_function(name: str) -> None:
    sym = gdb.lookup_static_symbol(name) or gdb.lookup_global_symbol(name)
    if sym is None or sym.addr_class != gdb.SYMBOL_LOC_BLOCK:
        _say(None)
        return
    _say({"file": sym.symtab.filename, "line": sym.line, "addr": int(sym.value().address)})


def qp_symtab(spec: str) -> None:
    """The file a ``SRC:LINE`` names, as gdb spells it (its symtab is expanded for the line table)."""
    try:
        _, sals = gdb.decode_line(spec)
    except gdb.error as exc:
        _say({"error": str(exc)})
        return
    files = sorted({s.symtab.filename for s in sals or () if s.symtab is not None})
    _say({"files": files})


def _member(t: gdb.Type, name: str) -> tuple[int, gdb.Type, int] | None:
    """(byte offset, member type) of ``name`` in struct/union ``t``, looking into anonymous members."""
    for f in t.fields():
        off = 0 if t.code == gdb.TYPE_CODE_UNION else f.bitpos // 8
        if f.name == name:
            if f.bitsize:
                return off, f.type, f.bitsize
            return off, f.type, 0
        if not f.name:
            inner = _real(f.type)
            if inner.code in (gdb.TYPE_CODE_STRUCT, gdb.TYPE_CODE_UNION):
                found = _member(inner, name)
                if found is not None:
                    return off + found[0], found[1], found[2]
    return None


def _type_info(t: gdb.Type) -> dict[str, object]:
    r = _real(t)
    kinds = {gdb.TYPE_CODE_PTR: "pointer", gdb.TYPE_CODE_ARRAY: "array", gdb.TYPE_CODE_STRUCT: "struct",
             gdb.TYPE_CODE_UNION: "union"}  # fmt: skip
    kind = kinds.get(r.code, "scalar")
    # libdw's die_is_signed_type: DW_ATE_signed or DW_ATE_signed_char; enums and pointers have no encoding.
    signed = r.code in (gdb.TYPE_CODE_INT, gdb.TYPE_CODE_CHAR) and bool(r.is_signed)
    target = None
    if kind in ("pointer", "array"):
        target = str(_real(r.target()))
    return {"kind": kind, "size": r.sizeof, "signed": signed, "name": str(t), "target": target}


def qp_access(var: str, pc: int, fields: list[list[str]]) -> None:
    """Walk ``var`` (looked up in the block at ``pc``) through ``fields`` ([op, name or index], ...).

    Each step is ``["deref", off]`` (a new dereference) or ``["add", off]`` (an offset
    into the memory the last dereference reads), as perf's convert_variable_fields builds them.
    """
    block = gdb.block_for_pc(pc)
    sym = gdb.lookup_symbol(var, block)[0] if block is not None else None
    if sym is None:
        sym = gdb.lookup_static_symbol(var) or gdb.lookup_global_symbol(var)
    if sym is None or (not sym.is_variable and not sym.is_argument):
        _say({"error": "notfound"})
        return
    t = _real(sym.type)
    steps = []
    path = var
    bits = 0
    for op, what in fields:
        if op == "[]":
            if t.code not in (gdb.TYPE_CODE_ARRAY, gdb.TYPE_CODE_PTR):
                _say({"error": f"{path} is not an array nor pointer"})
                return
            elem = _real(t.target())
            steps.append(["add" if t.code == gdb.TYPE_CODE_ARRAY else "deref", elem.sizeof * int(what)])
            t, path = elem, f"{path}[{what}]"
            continue
        if t.code == gdb.TYPE_CODE_PTR:
            if op != "->":
                _say({"error": f"{path} is a pointer: use {path}->{what}"})
                return
            t = _real(t.target())
            if t.code not in (gdb.TYPE_CODE_STRUCT, gdb.TYPE_CODE_UNION):
                _say({"error": f"{path} does not point to a struct or union"})
                return
            found = _member(t, what)
            if found is None:
                _say({"error": f"{t} has no member {what}"})
                return
            steps.append(["deref", found[0]])
        else:
            if t.code not in (gdb.TYPE_CODE_STRUCT, gdb.TYPE_CODE_UNION):
                _say({"error": f"{path} is not a struct or union"})
                return
            if op != ".":
                _say({"error": f"{path} is not a pointer: use {path}.{what}"})
                return
            found = _member(t, what)
            if found is None:
                _say({"error": f"{t} has no member {what}"})
                return
            steps.append(["add", found[0]])
        bits = found[2]
        t, path = _real(found[1]), f"{path}{op}{what}"
    info = _type_info(t)
    info["bitfield"] = bits
    _say({"steps": steps, "type": info, "global": sym.addr_class == gdb.SYMBOL_LOC_STATIC, "argument": sym.is_argument})
