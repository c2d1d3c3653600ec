"""In-guest maps: a detour that folds each hit into ``table[key]`` in its CPU's hash table.

For the shell's and ``trace``'s aggregations of one event when every part of
the key, and the aggregated value, can be computed at the hit without the
host (a :class:`KeySpec`: register integers, their hist() bucket, the CPU,
the task's pid and comm).  The detour builds the key on the stack, finds its
slot in a per-CPU open-addressing table in guest RAM and counts the hit
there (adding the value to the slot's sum, min and max), waking nobody and
writing no ring; the host sums the CPUs' tables when it reads them.
Interrupts are off while a CPU updates its own table, so its slots need no
atomics.  A hit that finds no free slot within ``MAX_PROBE`` of its key's
hash is counted in ``lost`` instead (never silently).

One slot: the key's words (u64 each; ``comm`` takes two), then the count,
then, with a value, its sum, min and max.  A slot is taken once its count is
non-zero; the key is written first.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from iced_x86 import Code, Instruction, MemoryOperand, Register

from qprobe.arch.inguest import KeyPart, KeySpec, MapKey, MapSlot
from qprobe.arch.x86_64.ptregs import PT_REGS_ORDER

if TYPE_CHECKING:
    from iced_x86._iced_x86_py import Register as RegisterKind
from qprobe.arch.x86_64.detour import (
    _mem,
    _r,
    encode_detour,
    locked_inc,
    restore_regs,
    save_regs,
    simm32,
    task_comm,
    task_pid,
)

TABLE_SHIFT = 10
TABLE_ENTRIES = 1 << TABLE_SHIFT
MAX_PROBE = 32  # slots tried before a hit counts as lost
GOLDEN = 0x9E3779B97F4A7C15  # Fibonacci hashing: the top bits of h * 2^64/phi
U64 = (1 << 64) - 1
COMM_LEN = 16  # TASK_COMM_LEN, unchanged since Linux 2.6


def slot_words(spec: KeySpec) -> int:
    return spec.words + (4 if spec.value is not None else 1)


def table_size(spec: KeySpec) -> int:
    """One CPU's table, in bytes."""
    return TABLE_ENTRIES * slot_words(spec) * 8


def typed(part: KeyPart, raw: int) -> int:
    """A register's 64-bit value read as ``part``'s integer type (signed as a Python int)."""
    v = raw & ((1 << part.bits) - 1)
    if part.signed and v >> (part.bits - 1):
        v -= 1 << part.bits
    return v


def part_words(part: KeyPart, raw: int = 0, cpu: int = 0, pid: int = 0, comm: bytes = b"") -> tuple[int, ...]:
    """The words the detour computes for ``part`` (the host's model of it): ``raw`` is the register's value."""
    if part.kind == "reg":
        return (typed(part, raw) & U64,)
    if part.kind == "hist":
        v = typed(part, raw)
        return (0 if v < 0 else 1 if v == 0 else v.bit_length() + 1,)
    if part.kind == "cpu":
        return (cpu,)
    if part.kind == "pid":
        return (pid & 0xFFFFFFFF,)
    name = comm[:COMM_LEN].ljust(COMM_LEN, b"\0")
    return struct.unpack("<2Q", name)


def key_hash(words: tuple[int, ...]) -> int:
    h = 0
    for w in words:
        h = ((h ^ w) * GOLDEN) & U64
    return h


def slot_index(words: tuple[int, ...]) -> int:
    return key_hash(words) >> (64 - TABLE_SHIFT)


def parse_tables(spec: KeySpec, raw: bytes) -> dict[tuple[int, ...], MapSlot]:
    """Key words -> the slot, summed over the CPUs' tables in ``raw``."""
    k, n = spec.words, slot_words(spec)
    value = spec.value
    out: dict[tuple[int, ...], MapSlot] = {}
    for i in range(len(raw) // (n * 8)):
        words = struct.unpack_from(f"<{n}Q", raw, i * n * 8)
        key, count = words[:k], words[k]
        if not count:
            continue
        if value is None:
            slot = MapSlot(count)
        else:
            total, lo, hi = (typed(KeyPart("reg", bits=64, signed=value.signed), w) for w in words[k + 1 : k + 4])
            slot = MapSlot(count, total, lo, hi)
        old = out.get(key)
        out[key] = slot if old is None else old.merge(slot)
    if value is not None:  # the CPUs' sums added as one CPU's would be: wrapping at 64 bits, read as the type
        wrap = KeyPart("reg", bits=64, signed=value.signed)
        out = {key: MapSlot(s.count, typed(wrap, s.total), s.min, s.max) for key, s in out.items()}
    return out


def decode_key(spec: KeySpec, words: tuple[int, ...]) -> MapKey:
    """A key's words as its parts: ``comm`` (two words) as text, ``pid`` signed, the rest as they are."""
    it = iter(words)
    out: list[int | str] = []
    for part in spec.parts:
        if part.kind == "comm":
            out.append(task_comm(next(it).to_bytes(8, "little") + next(it).to_bytes(8, "little")))
        elif part.kind == "pid":
            out.append(task_pid(next(it)))
        else:
            out.append(next(it))
    return tuple(out)


_LOAD = {  # (bits, signed) -> how rax gets the value from a 64-bit stack word
    (64, False): Code.MOV_R64_RM64, (64, True): Code.MOV_R64_RM64,
    (32, False): Code.MOV_R32_RM32, (32, True): Code.MOVSXD_R64_RM32,
    (16, False): Code.MOVZX_R32_RM16, (16, True): Code.MOVSX_R64_RM16,
    (8, False): Code.MOVZX_R32_RM8, (8, True): Code.MOVSX_R64_RM8,
}  # fmt: skip


def _stack(word: int) -> MemoryOperand:
    """``[rsp + 8*word]``, a word of the key buffer (a narrower read takes its low part: x86 is little-endian)."""
    return MemoryOperand(Register.RSP, Register.NONE, 1, word * 8, 1, False, Register.NONE)


def _register(name: str) -> RegisterKind:
    return _r(_gdb(name))


def _gdb(name: str) -> str:
    return "r" + name if not name.startswith("r") else name


def build_keyed_detour(
    address: int, spec: KeySpec, tables: int, cpu_number: int, task: tuple[int, int, int], hits: int, lost: int,
    relocated: bytes, resume: int,
) -> tuple[bytes, int]:  # fmt: skip
    """The detour at ``address`` and the offset its relocated instructions start at.

    ``tables`` is CPU 0's table (CPU n's is ``table_size(spec) * n`` further); ``cpu_number`` the
    per-CPU offset of the CPU's number; ``task`` the per-CPU offset of ``current_task`` and
    offsetof(task_struct, pid) and (…, comm); ``hits`` and ``lost`` the probe's u64 counters.
    """
    return encode_detour(keyed_code(spec, tables, cpu_number, task, hits, lost), address, relocated, resume)


def keyed_code(spec: KeySpec, tables: int, cpu_number: int, task: tuple[int, int, int], hits: int, lost: int,
               regs: RegisterKind | None = None) -> list[Instruction]:  # fmt: skip
    """The fold of one hit, every register kept: the key's registers as they are (``regs`` None), or from the
    ``struct pt_regs`` at ``regs``."""
    c = Instruction
    rax, rcx, rdx, rsi = Register.RAX, Register.RCX, Register.RDX, Register.RSI
    loop, empty, found, out, nxt = 1, 2, 3, 4, 5
    labels = iter(range(100, 1 << 20))
    current, pid_off, comm_off = task
    k = spec.words
    words = slot_words(spec)
    buf = k + (1 if spec.value is not None else 0)  # the key's words, then the value: on the stack

    def labelled(insn: Instruction, label: int) -> Instruction:
        insn.ip = label
        return insn

    saved = ("rax", "rbx", "rcx", "rdx", "rsi")
    code = [*save_regs(*saved), locked_inc(hits)]
    if buf:
        code.append(c.create_reg_i32(Code.SUB_RM64_IMM32, Register.RSP, buf * 8))
    # Nothing was changed yet but rsp: the registers still hold their values at the probe. Copy them first.
    slots: list[tuple[int, KeyPart]] = []
    w = 0
    for part in spec.parts:
        slots.append((w, part))
        w += part.words
    if spec.value is not None:
        slots.append((k, spec.value))
    for at, part in slots:
        if part.kind not in ("reg", "hist"):
            continue
        if regs is None:
            code.append(c.create_mem_reg(Code.MOV_RM64_R64, _stack(at), _register(part.reg)))
        else:
            pt = MemoryOperand(regs, Register.NONE, 1, 8 * PT_REGS_ORDER.index(_gdb(part.reg)), 1, False,
                               Register.NONE)  # fmt: skip
            code += [c.create_reg_mem(Code.MOV_R64_RM64, rax, pt), c.create_mem_reg(Code.MOV_RM64_R64, _stack(at), rax)]
    for at, part in slots:
        if part.kind in ("reg", "hist"):
            dest = rax if part.bits == 64 or part.signed else Register.EAX
            code.append(c.create_reg_mem(_LOAD[(part.bits, part.signed)], dest, _stack(at)))
            if part.kind == "hist":
                negative, zero, bucket = next(labels), next(labels), next(labels)
                code.append(c.create_reg_reg(Code.TEST_RM64_R64, rax, rax))
                if part.signed:
                    code.append(c.create_branch(Code.JS_REL32_64, negative))
                code += [
                    c.create_branch(Code.JE_REL32_64, zero),
                    c.create_reg_reg(Code.BSR_R64_RM64, rax, rax),
                    c.create_reg_i32(Code.ADD_RM64_IMM8, rax, 2),
                    c.create_branch(Code.JMP_REL32_64, bucket),
                    labelled(c.create_reg_reg(Code.XOR_R32_RM32, Register.EAX, Register.EAX), negative),
                    c.create_branch(Code.JMP_REL32_64, bucket),
                    labelled(c.create_reg_u32(Code.MOV_R32_IMM32, Register.EAX, 1), zero),
                    labelled(c.create(Code.NOPD), bucket),
                ]
        elif part.kind == "cpu":
            code.append(c.create_reg_mem(Code.MOV_R32_RM32, Register.EAX, _mem(disp=cpu_number, seg="gs")))
        else:
            code.append(c.create_reg_mem(Code.MOV_R64_RM64, rcx, _mem(disp=current, seg="gs")))
            if part.kind == "pid":
                code.append(c.create_reg_mem(Code.MOV_R32_RM32, Register.EAX, _mem("rcx", pid_off)))
            else:
                code += [
                    c.create_reg_mem(Code.MOV_R64_RM64, rax, _mem("rcx", comm_off + 8)),
                    c.create_mem_reg(Code.MOV_RM64_R64, _stack(at + 1), rax),
                    c.create_reg_mem(Code.MOV_R64_RM64, rax, _mem("rcx", comm_off)),
                ]
        code.append(c.create_mem_reg(Code.MOV_RM64_R64, _stack(at), rax))
    # rcx: the key's hash, then the index of the slot tried; rdx: this CPU's table; rax: the slot
    code += [c.create_reg_reg(Code.XOR_R32_RM32, Register.ECX, Register.ECX)]
    if k:
        code.append(c.create_reg_u64(Code.MOV_R64_IMM64, rdx, GOLDEN))
        for j in range(k):
            code += [
                c.create_reg_mem(Code.XOR_R64_RM64, rcx, _stack(j)),
                c.create_reg_reg(Code.IMUL_R64_RM64, rcx, rdx),
            ]
        code.append(c.create_reg_i32(Code.SHR_RM64_IMM8, rcx, 64 - TABLE_SHIFT))
    code += [
        c.create_reg_mem(Code.MOV_R32_RM32, Register.EDX, _mem(disp=cpu_number, seg="gs")),
        c.create_reg_reg_i32(Code.IMUL_R64_RM64_IMM32, rdx, rdx, table_size(spec)),
        c.create_reg_i32(Code.ADD_RM64_IMM32, rdx, simm32(tables)),
        c.create_reg_u32(Code.MOV_R32_IMM32, Register.EBX, MAX_PROBE),
        labelled(c.create_reg_reg_i32(Code.IMUL_R64_RM64_IMM32, rax, rcx, words * 8), loop),
        c.create_reg_reg(Code.ADD_R64_RM64, rax, rdx),
        c.create_mem_i32(Code.CMP_RM64_IMM8, _mem("rax", k * 8), 0),
        c.create_branch(Code.JE_REL32_64, empty),
    ]
    for j in range(k):
        code += [
            c.create_reg_mem(Code.MOV_R64_RM64, rsi, _stack(j)),
            c.create_reg_mem(Code.CMP_R64_RM64, rsi, _mem("rax", j * 8)),
            c.create_branch(Code.JNE_REL32_64, nxt),
        ]
    code += [
        c.create_branch(Code.JMP_REL32_64, found),
        labelled(c.create_reg(Code.INC_RM32, Register.ECX), nxt),
        c.create_reg_i32(Code.AND_RM32_IMM32, Register.ECX, TABLE_ENTRIES - 1),
        c.create_reg(Code.DEC_RM32, Register.EBX),
        c.create_branch(Code.JNE_REL32_64, loop),
        locked_inc(lost),
        c.create_branch(Code.JMP_REL32_64, out),
    ]
    # A free slot: the key first, and the value as its first min and max (its sum is still zero).
    stores = [(j, (j,)) for j in range(k)] + ([(k, (k + 2, k + 3))] if spec.value is not None else [])
    take = []
    for j, fields in stores:
        take.append(c.create_reg_mem(Code.MOV_R64_RM64, rsi, _stack(j)))
        take += [c.create_mem_reg(Code.MOV_RM64_R64, _mem("rax", f * 8), rsi) for f in fields]
    if not take:
        take.append(c.create(Code.NOPD))
    take[0].ip = empty
    code += take
    count = c.create_mem(Code.INC_RM64, _mem("rax", k * 8))
    code.append(labelled(count, found))
    if spec.value is not None:
        keep_min, keep_max = next(labels), next(labels)
        below, above = (
            (Code.JGE_REL32_64, Code.JLE_REL32_64) if spec.value.signed else (Code.JAE_REL32_64, Code.JBE_REL32_64)
        )
        code += [
            c.create_reg_mem(Code.MOV_R64_RM64, rsi, _stack(k)),
            c.create_mem_reg(Code.ADD_RM64_R64, _mem("rax", (k + 1) * 8), rsi),
            c.create_reg_mem(Code.CMP_R64_RM64, rsi, _mem("rax", (k + 2) * 8)),
            c.create_branch(below, keep_min),
            c.create_mem_reg(Code.MOV_RM64_R64, _mem("rax", (k + 2) * 8), rsi),
            labelled(c.create_reg_mem(Code.CMP_R64_RM64, rsi, _mem("rax", (k + 3) * 8)), keep_min),
            c.create_branch(above, keep_max),
            c.create_mem_reg(Code.MOV_RM64_R64, _mem("rax", (k + 3) * 8), rsi),
            labelled(c.create(Code.NOPD), keep_max),
        ]
    tail = restore_regs(*saved)
    if buf:
        tail.insert(0, c.create_reg_i32(Code.ADD_RM64_IMM32, Register.RSP, buf * 8))
    tail[0].ip = out
    return code + tail
