"""Fetch-argument expressions: the tree, its parser and its evaluation.

The parser is a transcription of ``parse_probe_arg`` and ``parse_probe_vars``
(kernel/trace/trace_probe.c, Linux 6.1) into a tree instead of a fetch_insn
array.  It still counts the instructions the kernel would emit, because the
kernel's 16-slot limit decides where "Dereference is too much nested" is
reported, and it reproduces the kernel's error offsets (including the
off-by-one of ``+u``), so carets match the kernel's error_log.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import messages as M
from .btf import CType
from .context import U64_MASK, FetchContext, UserFetchContext, read_uint
from .dialect import BASE, Dialect
from .kstrto import isalpha, isdigit, kstrtol, kstrtoul, to_s32

# TPARG_FL_* from trace_probe.h
FL_RETURN = 1
FL_KERNEL = 2
FL_FENTRY = 4
FL_MASK = 0xF
# TPARG_FL_USER (Linux 6.5's name for what 6.1 says by leaving FL_KERNEL out): a uprobe's argument.
FL_USER = 16


class ArgError(Exception):
    """A parse error at ``offset`` inside the current word of the command.

    ``logged`` is False where the kernel fails with -EINVAL and writes nothing
    to error_log (qprobe still tells its user what is wrong).
    """

    def __init__(self, offset: int, message: str, logged: bool = True) -> None:
        super().__init__(message)
        self.offset = offset
        self.message = message
        self.logged = logged


@dataclass(frozen=True)
class Reg:
    """``%REG``: a pt_regs slot, by its pt_regs name (the kernel keeps the offset: arm64's ``%lr`` is x30)."""

    name: str


@dataclass(frozen=True)
class Stack:
    """``$stackN``: the Nth word on the kernel stack."""

    n: int


@dataclass(frozen=True)
class StackPointer:
    """``$stack``: the kernel stack pointer."""


@dataclass(frozen=True)
class RetVal:
    """``$retval``: the return value (return probes only)."""


@dataclass(frozen=True)
class Comm:
    """``$comm``: the current task's comm (a string, cannot be dereferenced)."""


@dataclass(frozen=True)
class Arg:
    """``$argN``: the Nth (1-based) function argument (function entry only)."""

    n: int


@dataclass(frozen=True)
class Imm:
    """``\\IMM`` or the address of ``@ADDR``: a constant."""

    value: int


@dataclass(frozen=True)
class ImmString:
    """``\\"text"``: a constant string."""

    value: str


@dataclass(frozen=True)
class FileOffset:
    """The address of ``@+OFFSET`` in a uprobe: where the probed file's offset is mapped in the hitting process.

    ``translate_user_vaddr`` (trace_uprobe.c): the probe's address minus its
    file offset, plus this one.
    """

    offset: int


@dataclass(frozen=True)
class SymbolAddr:
    """The address of ``@SYM[+|-offs]``, resolved when the probe is registered.

    ``spec`` is the text after ``@``.  ``offset`` is None when the part after
    the first ``+``/``-`` is not a number: the kernel accepts such an
    argument when parsing and fails at registration.
    """

    spec: str
    name: str
    offset: int | None


@dataclass(frozen=True)
class Deref:
    """``+|-[u]OFFS(inner)``; also ``@ADDR``/``@SYM`` (a deref at offset 0)."""

    inner: Node
    offset: int  # a C int, as in fetch_insn
    user: bool = False


Node = Reg | Stack | StackPointer | RetVal | Comm | Arg | Imm | ImmString | SymbolAddr | FileOffset | Deref


class Code:
    """The parse of one argument body: the kernel's fetch_insn cursor and parse context.

    ``idx`` enforces FETCH_INSN_MAX.  ``offset`` is the context's offset as a
    6.5+ parser leaves it (a dereference moves it past its brace);
    ``last_type`` is the BTF type of the last BTF variable (``ctx->last_type``)
    and ``btf_bitfield`` its bitfield, if it is a member that needs one.
    """

    END = M.FETCH_INSN_MAX - 1

    def __init__(self, dialect: Dialect = BASE, offset: int = 0, func: str | None = None) -> None:
        self.idx = 0
        self.dialect = dialect
        self.offset = offset
        self.func = func  # ctx->funcname: the probed symbol (None for an address)
        self.last_type: CType | None = None
        self.btf_bitfield: tuple[int, int] | None = None  # ctx->last_bitsize, ctx->last_bitoffs

    def advance(self, offs: int) -> None:
        """``if (++code == end)``: one more instruction, or too many."""
        self.idx += 1
        if self.idx == self.END:
            raise ArgError(offs, M.TOO_MANY_OPS)


def split_symbol_offset(spec: str) -> tuple[str, int | None]:
    """``traceprobe_split_symbol_offset``: ("sym", offset) or ("sym", None) if bad."""
    cut = min((i for i in (spec.find("+"), spec.find("-")) if i >= 0), default=-1)
    if cut < 0:
        return spec, 0
    return spec[:cut], kstrtol(spec[cut:], 0)


def _stack_bound(code: Code, offs: int) -> int:
    bound = code.dialect.param_max_stack
    if bound is None:
        raise ArgError(offs, "qprobe: the kernel's THREAD_SIZE is unknown, which bounds $stackN and $argN",
                       logged=False)  # fmt: skip
    return bound


def _parse_vars(var: str, flags: int, offs: int, code: Code) -> Node:
    """``parse_probe_vars``: the text after ``$``."""
    dialect = code.dialect
    if var == "retval" or (dialect.meta_args and var.startswith("retval")):
        if not flags & FL_RETURN:
            raise ArgError(offs, M.RETVAL_ON_PROBE)
        if dialect.btf_args and flags & FL_KERNEL:  # a uprobe's $retval has no BTF type
            return _parse_btf_arg("$" + var, flags, offs, code)
        return RetVal()
    if var.startswith("stack"):
        rest = var[5:]
        if rest == "":
            return StackPointer()
        if isdigit(rest):
            n = kstrtoul(rest, 10)
            if n is None:
                raise ArgError(offs, M.BAD_VAR)
            if (flags & FL_KERNEL) and n > _stack_bound(code, offs):
                raise ArgError(offs, M.BAD_STACK_NUM)
            return Stack(n)
        raise ArgError(offs, M.BAD_VAR)
    if var in ("comm", "COMM"):
        return Comm()
    if dialect.meta_args and var.startswith("arg"):
        # 6.5 on: the number is checked first, then the place (entry, or exit where the
        # kernel fetches the argument at entry for the return probe, Linux 6.10).
        n = kstrtoul(var[3:], 10)
        if n is None:
            raise ArgError(offs, M.BAD_VAR)
        if n == 0 or n > _stack_bound(code, offs):
            raise ArgError(offs, M.BAD_ARG_NUM)
        if is_function_entry(flags) or (is_function_return(flags) and dialect.return_args):
            return Arg(n)
        raise ArgError(offs, M.NOFENTRY_ARGS)
    if (flags & FL_MASK) == (FL_KERNEL | FL_FENTRY) and var.startswith("arg"):
        n = kstrtoul(var[3:], 10)
        if n is None:
            raise ArgError(offs, M.BAD_VAR)
        if n == 0 or n > _stack_bound(code, offs):
            raise ArgError(offs, M.BAD_ARG_NUM)
        return Arg(n)
    raise ArgError(offs, M.BAD_VAR)


def is_function_entry(flags: int) -> bool:
    """``tparg_is_function_entry``."""
    return (flags & FL_MASK) == (FL_KERNEL | FL_FENTRY)


def is_function_return(flags: int) -> bool:
    """``tparg_is_function_return``."""
    return (flags & FL_MASK) == (FL_KERNEL | FL_RETURN)


def _split_field(name: str, offs: int) -> tuple[str, str | None, bool]:
    """``split_next_field``: (the name, what follows ``.`` or ``->`` or None, whether it was ``->``)."""
    cut = min((i for i in (name.find("."), name.find("-")) if i >= 0), default=-1)
    if cut < 0:
        return name, None, False
    if name[cut] == ".":
        return name[:cut], name[cut + 1 :], False
    if name[cut + 1 : cut + 2] != ">":
        raise ArgError(offs + cut, M.BAD_HYPHEN)
    return name[:cut], name[cut + 2 :], True


def _parse_btf_arg(varname: str, flags: int, offs: int, code: Code) -> Node:
    """``parse_btf_arg``: a parameter of the probed function by name, or ``$retval``, typed by BTF.

    ``->field`` (and ``.field`` inside a structure) follows pointers to structures
    as the kernel's ``parse_btf_field`` does.  A parameter in a return probe is
    the value the entry saw (``FETCH_OP_EDATA``).
    """
    if code.func is None:
        raise ArgError(offs, M.BAD_FETCH_ARG, logged=False)  # -EINVAL, nothing logged
    var, field, is_ptr = _split_field(varname, offs)
    field_at = offs + len(varname) - len(field) if field is not None else offs
    if field is not None and not is_ptr:
        raise ArgError(field_at, M.NOSUP_DAT_ARG)
    proto = code.dialect.proto(code.func)
    node: Node
    if flags & FL_RETURN and var == "$retval":
        if proto is None:
            if field is not None:
                raise ArgError(field_at, M.NO_BTF_ENTRY)
            return RetVal()
        if proto.ret is None:
            raise ArgError(offs, M.NO_RETVAL)
        node, ctype = RetVal(), proto.ret
    else:
        if proto is None or not proto.params:
            raise ArgError(offs, M.NO_BTF_ENTRY)
        found = next(((i, t) for i, (name, t) in enumerate(proto.params) if name == var), None)
        if found is None:
            raise ArgError(offs, M.NO_BTFARG)
        node, ctype = Arg(found[0] + 1), found[1]
    code.last_type, code.btf_bitfield = ctype, None
    return node if field is None else _parse_btf_field(field, ctype, node, field_at, code)


def _parse_btf_field(field: str, ctype: CType, node: Node, offs: int, code: Code) -> Node:
    """``parse_btf_field``: one dereference per ``->``, at the members' summed offset."""
    btf = code.dialect.btf
    assert btf is not None  # a prototype came from it
    rest: str | None = field
    while rest is not None:
        if ctype.kind != "ptr":
            raise ArgError(offs, M.NO_PTR_STRCT)
        if ctype.target is None:
            raise ArgError(offs, M.BAD_BTF_TID)
        ctype = ctype.target
        bits, width = 0, 0
        while rest is not None:
            name, after, is_ptr = _split_field(rest, offs)
            if ctype.kind not in ("struct", "union"):
                raise ArgError(offs, M.BAD_BTF_TID)
            member = btf.member(ctype, name)
            if member is None:
                raise ArgError(offs, M.NO_BTF_FIELD)
            bits += member.bit_offset
            width, ctype = member.bitfield, member.type
            if after is not None:
                offs += len(rest) - len(after)
            rest = after
            if is_ptr:
                break
        code.advance(offs)
        node = Deref(node, bits // 8)
        if ctype.kind == "int" and ctype.bits not in (8, 16, 32, 64):
            # A bitfield in the integer type itself (BTF_INT_OFFSET), which BTF from pahole does not use.
            raise ArgError(offs, "qprobe: BTF integers of odd widths are not supported", logged=False)
        # (width, bit offset) of a bitfield member that does not fill whole bytes from a byte boundary.
        code.btf_bitfield = (width, bits % 8) if width % 8 or bits % 8 else None
        code.last_type = ctype
    return node


def _str_to_immediate(text: str) -> int | None:
    if isdigit(text):
        return kstrtoul(text, 0)
    if text[:1] == "-":
        value = kstrtol(text, 0)
    elif text[:1] == "+":
        value = kstrtol(text[1:], 0)
    else:
        return None
    return None if value is None else value & U64_MASK


def _parse_deref(arg: str, flags: int, offs: int, code: Code) -> Node:
    """The ``+``/``-`` case of parse_probe_arg, offsets computed as in C."""
    buf = arg
    user = False
    if buf[1:2] == "u":
        user = True
        buf = buf[0] + buf[2:]  # arg[1] = arg[0]; arg++
    if buf[:1] == "+":
        buf = buf[1:]
    paren = buf.find("(")
    if paren < 0:
        raise ArgError(offs, M.DEREF_NEED_BRACE)
    offset = kstrtol(buf[:paren], 0)
    if offset is None:
        raise ArgError(offs, M.BAD_DEREF_OFFS)
    offs += paren + 1 + (1 if buf[:1] != "-" else 0)
    rest = buf[paren + 1 :]
    close = rest.rfind(")")
    if close < 0:
        raise ArgError(offs + len(rest), M.DEREF_OPEN_BRACE)
    inner = parse_probe_arg(rest[:close], flags, offs, code)
    code.offset = offs  # ctx->offset = cur_offs: the outermost dereference sets it last
    if isinstance(inner, Comm | ImmString):
        raise ArgError(offs, M.COMM_CANT_DEREF)
    code.advance(offs)
    code.last_type = None
    return Deref(inner, to_s32(offset), user)


def parse_probe_arg(arg: str, flags: int, offs: int, code: Code) -> Node:
    """``parse_probe_arg``: one expression (no name, no type) at ``offs``."""
    head = arg[:1]
    if head == "$":
        return _parse_vars(arg[1:], flags, offs, code)
    if head == "%":
        reg = code.dialect.register(arg[1:])
        if reg is None:
            raise ArgError(offs, M.BAD_REG_NAME)
        return Reg(reg)
    if head == "@":
        node: Node
        if isdigit(arg[1:2]):
            addr = kstrtoul(arg[1:], 0)
            if addr is None:
                raise ArgError(offs, M.BAD_MEM_ADDR)
            node = Imm(addr)
        elif arg[1:2] == "+":
            if flags & FL_KERNEL:
                raise ArgError(offs, M.FILE_ON_KPROBE)
            foffs = kstrtol(arg[2:], 0)
            if foffs is None:
                raise ArgError(offs, M.BAD_FILE_OFFS)
            code.advance(offs)
            # The kernel's FETCH_OP_DEREF after FETCH_OP_FOFFS keeps the parsed offset as its own
            # (code->offset = offset in parse_probe_arg's '@' case): the value is read at the
            # translated address plus the offset once more, and so is it here.
            return Deref(FileOffset(foffs), to_s32(foffs))
        else:
            if not flags & FL_KERNEL:
                raise ArgError(offs, M.SYM_ON_UPROBE)
            name, offset = split_symbol_offset(arg[1:])
            node = SymbolAddr(arg[1:], name, offset)
            code.advance(offs)  # FETCH_NOP_SYMBOL, then FETCH_OP_IMM
        code.advance(offs)
        return Deref(node, 0)
    if head in ("+", "-"):
        return _parse_deref(arg, flags, offs, code)
    if head == "\\":
        if arg[1:2] == '"':
            text = arg[2:]
            # 6.1.0's C checked the '"' just before an empty body (str[len - 1]) and took ``\"`` as
            # an empty string; later kernels and stable 6.1 (Debian's 6.1.192) refuse it, as qprobe does.
            if not text or text[-1] != '"':
                raise ArgError(offs + 2 + len(text), M.IMMSTR_NO_CLOSE)
            return ImmString(text[:-1])
        value = _str_to_immediate(arg[1:])
        if value is None:
            raise ArgError(offs + 1, M.BAD_IMM)
        return Imm(value)
    if code.dialect.meta_args and (isalpha(head) or head == "_"):  # a BTF variable (Linux 6.5 on)
        if not (is_function_entry(flags) or is_function_return(flags)) or not code.dialect.btf_args:
            raise ArgError(offs, M.NOSUP_BTFARG)
        return _parse_btf_arg(arg, flags, offs, code)
    raise ArgError(offs, M.BAD_FETCH_ARG)


def symbol_refs(node: Node) -> list[SymbolAddr]:
    """Every ``@SYM`` in the expression, innermost first."""
    while isinstance(node, Deref):
        node = node.inner
    return [node] if isinstance(node, SymbolAddr) else []


def fetch(node: Node, ctx: FetchContext) -> int:
    """Stages 1 and 2 of process_fetch_insn: the unsigned long value.

    Raises MemoryFault (a bad dereference) or KeyError (an unknown symbol);
    strings (Comm, ImmString) are handled by the caller, never here.
    """
    match node:
        case Reg(name):
            return ctx.reg(name) & U64_MASK
        case Stack(n):
            return ctx.stack(n) & U64_MASK
        case StackPointer():
            return ctx.stack_pointer() & U64_MASK
        case RetVal():
            return ctx.retval() & U64_MASK
        case Arg(n):
            return ctx.arg(n) & U64_MASK
        case Imm(value):
            return value
        case FileOffset(offset) if isinstance(ctx, UserFetchContext):  # only a uprobe's context has a file
            return ctx.file_address(offset) & U64_MASK
        case SymbolAddr(_, name, offset):
            if offset is None:
                raise KeyError(name)
            return (ctx.symbol_address(name) + offset) & U64_MASK
        case Deref(inner, offset, user):
            return read_uint(ctx, fetch(inner, ctx) + offset, 8, user)
    raise TypeError(f"{node!r} has no numeric value")
