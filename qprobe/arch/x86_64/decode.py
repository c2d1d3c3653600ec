"""Decoding guest kernel text with iced-x86.

Everything the kprobe layer decides (is this an instruction boundary, can it
run out of line, must it be emulated) starts from one decoded instruction.
This module turns bytes read from guest memory into :class:`Insn` values and
answers the boundary question the way Linux's ``can_probe()`` does: by decoding
linearly from the start of the function, because x86 has no other way to
tell where an instruction starts.

Bytes that qprobe itself has replaced by ``int3`` are passed in ``patched``
(address -> original byte) and put back before decoding, as the kernel's
``recover_probed_instruction()`` does with ``kp->opcode``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import iced_x86
from iced_x86 import Code, Decoder, DecoderError, FlowControl, Formatter, FormatterSyntax, Instruction, OpKind

from qprobe.errors import CannotProbe, NotInstructionBoundary

__all__ = [
    "MAX_INSN_SIZE",
    "Insn",
    "check_boundary",
    "code_name",
    "decode_all",
    "decode_one",
    "flow_control_name",
    "format_insn",
    "recover_bytes",
    "skip_prefixes",
]

#: Longest legal x86 instruction; Linux reads this many bytes per decode.
MAX_INSN_SIZE = 16

#: Legacy prefixes as Linux's inat tables classify them (group 1-4).
LEGACY_PREFIXES = frozenset((0xF0, 0xF2, 0xF3, 0x2E, 0x36, 0x3E, 0x26, 0x64, 0x65, 0x66, 0x67))

_CODE_NAMES: dict[int, str] = {v: k for k, v in vars(Code).items() if isinstance(v, int) and k.isupper()}
_FLOW_NAMES: dict[int, str] = {v: k.lower() for k, v in vars(FlowControl).items() if isinstance(v, int) and k.isupper()}
_MNEMONIC_NAMES: dict[int, str] = {
    v: k.lower() for k, v in vars(iced_x86.Mnemonic).items() if isinstance(v, int) and k.isupper()
}
_NEAR_BRANCH_KINDS = frozenset((OpKind.NEAR_BRANCH16, OpKind.NEAR_BRANCH32, OpKind.NEAR_BRANCH64))


def _make_formatter(rip_relative: bool) -> Formatter:
    """Intel syntax with 0x-hex, as kernel people read objdump -M intel output."""
    fmt = Formatter(FormatterSyntax.INTEL)
    fmt.hex_prefix = "0x"
    fmt.hex_suffix = ""
    fmt.uppercase_hex = False
    fmt.small_hex_numbers_in_decimal = False
    fmt.branch_leading_zeros = False
    fmt.rip_relative_addresses = rip_relative
    return fmt


_FORMATTER = _make_formatter(rip_relative=True)
_ABS_FORMATTER = _make_formatter(rip_relative=False)


def code_name(code: int) -> str:
    """iced ``Code`` value as its name, e.g. ``"CALL_REL32_64"``."""
    return _CODE_NAMES.get(code, str(code))


def flow_control_name(flow: int) -> str:
    """iced ``FlowControl`` value as a lower-case name, e.g. ``"indirect_call"``."""
    return _FLOW_NAMES.get(flow, str(flow))


def format_insn(instr: Instruction, *, absolute: bool = False) -> str:
    """Format one iced instruction; ``absolute`` shows rip-relative targets as addresses."""
    return (_ABS_FORMATTER if absolute else _FORMATTER).format(instr)


def skip_prefixes(raw: bytes) -> int:
    """Offset of the opcode in ``raw``: after legacy prefixes and one REX.

    Linux's ``skip_prefixes()``; VEX/EVEX prefixes are not skipped (callers
    that care look at iced's ``op_code()`` instead).
    """
    i = 0
    while i < len(raw) and raw[i] in LEGACY_PREFIXES:
        i += 1
    if i < len(raw) and 0x40 <= raw[i] <= 0x4F:
        i += 1
    return i


@dataclass(frozen=True)
class Insn:
    """One decoded instruction at a guest address.

    ``instr`` is iced's mutable ``Instruction``; treat it as read-only.
    ``disp_offset``/``disp_size`` locate the displacement bytes in ``raw``
    (iced's ConstantOffsets) so a rip-relative copy can be patched in place
    exactly as Linux's ``__copy_instruction()`` does.
    """

    addr: int
    length: int
    raw: bytes
    instr: Instruction = field(compare=False, repr=False)
    disp_offset: int = field(default=0, compare=False, repr=False)
    disp_size: int = field(default=0, compare=False, repr=False)

    @property
    def text(self) -> str:
        """Intel syntax, rip-relative operands as ``[rip+0x1234]``."""
        return format_insn(self.instr)

    @property
    def mnemonic(self) -> str:
        """Bare mnemonic in lower case, e.g. ``"call"``."""
        return _MNEMONIC_NAMES.get(self.instr.mnemonic, "?")

    @property
    def code(self) -> int:
        """iced ``Code`` (the exact opcode/operand form)."""
        return self.instr.code

    @property
    def code_name(self) -> str:
        return code_name(self.instr.code)

    @property
    def next_addr(self) -> int:
        return (self.addr + self.length) & 0xFFFFFFFFFFFFFFFF

    @property
    def is_rip_relative(self) -> bool:
        """True for ``[rip+disp32]`` (and ``[eip+disp32]``) memory operands."""
        return bool(self.instr.is_ip_rel_memory_operand)

    @property
    def memory_target(self) -> int | None:
        """Absolute address a rip-relative operand refers to, else None."""
        return self.instr.ip_rel_memory_address if self.is_rip_relative else None

    @property
    def flow_control(self) -> int:
        """iced ``FlowControl`` kind (next, call, conditional_branch, ...)."""
        return self.instr.flow_control

    @property
    def flow(self) -> str:
        return flow_control_name(self.instr.flow_control)

    @property
    def branch_target(self) -> int | None:
        """Target of a relative branch/call/loop/xbegin, else None."""
        for i in range(self.instr.op_count):
            if self.instr.op_kind(i) in _NEAR_BRANCH_KINDS:
                return self.instr.near_branch_target
        return None

    @property
    def opcode_offset(self) -> int:
        return skip_prefixes(self.raw)

    @property
    def is_invalid(self) -> bool:
        return self.instr.code == Code.INVALID

    def __str__(self) -> str:
        return f"{self.addr:#x}: {self.raw.hex(' ')}  {self.text}"


def recover_bytes(code: bytes, start: int, patched: Mapping[int, int] | None) -> bytes:
    """Put back the original bytes qprobe replaced with int3 (``patched``: addr -> byte)."""
    if not patched:
        return code
    buf = bytearray(code)
    if len(patched) < len(buf):
        for addr, orig in patched.items():
            off = addr - start
            if 0 <= off < len(buf):
                buf[off] = orig
    else:  # a thousand probes' bytes against one function's: look up the function's addresses instead
        for off in range(len(buf)):
            was = patched.get(start + off)
            if was is not None:
                buf[off] = was
    return bytes(buf)


def _decode_at(decoder: Decoder, code: bytes, start: int) -> Insn:
    instr = decoder.decode()
    addr = instr.ip
    off = addr - start
    if decoder.last_error == DecoderError.NO_MORE_BYTES:
        raise CannotProbe(
            f"the instruction at {addr:#x} is truncated: only {len(code) - off} byte(s) were read "
            f"({code[off:].hex(' ')})"
        )
    if instr.code == Code.INVALID:
        raise CannotProbe(f"invalid instruction encoding at {addr:#x} ({code[off : off + instr.len].hex(' ')})")
    offsets = decoder.get_constant_offsets(instr)
    return Insn(
        addr=addr,
        length=instr.len,
        raw=bytes(code[off : off + instr.len]),
        instr=instr,
        disp_offset=offsets.displacement_offset,
        disp_size=offsets.displacement_size,
    )


def decode_one(code: bytes, addr: int) -> Insn:
    """Decode the instruction at the start of ``code`` (which sits at ``addr``).

    Raises CannotProbe for an invalid or truncated encoding.
    """
    if not code:
        raise CannotProbe(f"no bytes to decode at {addr:#x}")
    decoder = Decoder(64, code[:MAX_INSN_SIZE], ip=addr)
    return _decode_at(decoder, code[:MAX_INSN_SIZE], addr)


def decode_all(code: bytes, start: int, *, patched: Mapping[int, int] | None = None) -> list[Insn]:
    """Linear sweep over a whole function's bytes.

    Raises CannotProbe at the first invalid or truncated instruction, since
    every boundary after it would be a guess.
    """
    code = recover_bytes(code, start, patched)
    decoder = Decoder(64, code, ip=start)
    out: list[Insn] = []
    while decoder.can_decode:
        out.append(_decode_at(decoder, code, start))
    return out


def _where(addr: int, func_start: int, name: str | None) -> str:
    return f"{name}+{addr - func_start:#x}" if name else f"{addr:#x}"


def check_boundary(
    code: bytes,
    func_start: int,
    addr: int,
    *,
    patched: Mapping[int, int] | None = None,
    name: str | None = None,
) -> Insn:
    """Return the instruction at ``addr`` if it starts on an instruction boundary.

    Linux's ``can_probe()``: decode from the start of the function (``code``
    holds the function's bytes from ``func_start``) and require that ``addr``
    is reached exactly. Like 6.1 (after the CONFIG_RETHUNK/SLS fix), an int3
    met on the way is decoded as a one-byte instruction rather than refused:
    compilers put int3 after ``ret``/``jmp *%reg`` to stop straight-line
    speculation. An int3 that qprobe itself wrote must be listed in
    ``patched`` so the original instruction is decoded instead.

    ``name`` (the symbol) only makes messages readable, e.g.
    ``vfs_read+0x3 is not an instruction boundary (nearest: +0x0 and +0x5)``.
    """
    where = _where(addr, func_start, name)
    end = func_start + len(code)
    if not func_start <= addr < end:
        raise NotInstructionBoundary(f"{where} is outside the function's {len(code)} bytes at {func_start:#x}")
    code = recover_bytes(code, func_start, patched)
    decoder = Decoder(64, code, ip=func_start)
    while decoder.can_decode:
        insn = _decode_at(decoder, code, func_start)
        if insn.addr == addr:
            return insn
        if insn.addr < addr < insn.next_addr:
            raise NotInstructionBoundary(
                f"{where} is not an instruction boundary "
                f"(nearest: +{insn.addr - func_start:#x} and +{insn.next_addr - func_start:#x})"
            )
    raise NotInstructionBoundary(f"{where} was not reached by decoding from the function start")
