"""User instructions performed on the host at a uprobe hit (X86Uprobes.arch_uprobe_emulate).

Each case's expected registers, flags and memory are worked out from the Intel SDM's description of the
instruction, not from the emulator; the encodings are the GNU assembler's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from qprobe.arch.x86_64.uprobes import X86Uprobes
from qprobe.errors import MemoryFault

sys.path.insert(0, str(Path(__file__).parent))
from fakes_x86_64 import FakeMem, FakeRegs

IP = 0x0000_5555_5555_4000
SP = 0x0000_7FFF_FFFF_E000
M64 = (1 << 64) - 1
CF, PF, AF, ZF, SF, OF, TF = 1 << 0, 1 << 2, 1 << 4, 1 << 6, 1 << 7, 1 << 11, 1 << 8
ARITH = CF | PF | AF | ZF | SF | OF
UP = X86Uprobes()


class UserMem(FakeMem):
    """Sparse memory with a fetch, and addresses the task could not access (a fault)."""

    def __init__(self, code: bytes) -> None:
        super().__init__()
        self.denied: set[int] = set()
        super().write(IP, code + b"\xcc" * 16)  # the text: not one of the task's writes
        self.writes: list[tuple[int, bytes]] = []

    def fetch(self, addr: int, size: int) -> bytes:
        return self.read(addr, size)

    def read(self, addr: int, size: int) -> bytes:
        if any(a in self.denied for a in range(addr, addr + size)):
            raise MemoryFault(addr)
        return super().read(addr, size)

    def write(self, addr: int, data: bytes) -> None:
        if any(a in self.denied for a in range(addr, addr + len(data))):
            raise MemoryFault(addr)
        self.writes.append((addr, data))
        super().write(addr, data)


def run(hexcode: str, mem: UserMem | None = None, **regs: int) -> tuple[FakeRegs, UserMem, bool]:
    mem = mem or UserMem(bytes.fromhex(hexcode))
    r = FakeRegs(sp=SP, **regs)
    r.ip = IP
    return r, mem, UP.arch_uprobe_emulate(r, mem)  # type: ignore[arg-type]


def after(hexcode: str, **regs: int) -> FakeRegs:
    r, _mem, done = run(hexcode, **regs)
    assert done, hexcode
    return r


def test_endbr64_and_nops_only_move_ip() -> None:
    for code in ("f30f1efa", "90", "0f1f00", "660f1f440000", "0f1f8000000000"):
        before = FakeRegs(sp=SP, ax=1, flags=0x2 | CF)
        r = after(code, ax=1, flags=0x2 | CF)
        assert r.ip == IP + len(bytes.fromhex(code))
        assert (r.ax, r.sp, r.flags) == (before.ax, before.sp, before.flags)


def test_push_r12_stores_below_rsp() -> None:
    r, mem, done = run("4154", r12=0x1122334455667788)  # push r12
    assert done and r.sp == SP - 8 and r.ip == IP + 2
    assert mem.writes == [(SP - 8, (0x1122334455667788).to_bytes(8, "little"))]


def test_push_rsp_pushes_its_value_before_the_push() -> None:
    r, mem, done = run("54")  # push rsp
    assert done and mem.u64(SP - 8) == SP and r.sp == SP - 8


def test_push_imm8_is_sign_extended() -> None:
    _r, mem, done = run("6aff")  # push -1
    assert done and mem.u64(SP - 8) == M64


def test_pop_rbx_loads_and_pop_rsp_takes_the_popped_value() -> None:
    mem = UserMem(bytes.fromhex("5b"))
    mem.put_u64(SP, 0xCAFE)
    r, _, done = run("5b", mem)  # pop rbx
    assert done and r.bx == 0xCAFE and r.sp == SP + 8
    mem = UserMem(bytes.fromhex("5c"))
    mem.put_u64(SP, 0x1000)
    r, _, done = run("5c", mem)  # pop rsp: rsp is the value popped, not that plus 8
    assert done and r.sp == 0x1000


def test_mov_between_registers_and_32_bit_zero_extension() -> None:
    assert after("4889fb", di=0x8000_0000_0000_0001, bx=5).bx == 0x8000_0000_0000_0001  # mov rbx,rdi
    assert after("89f8", di=0xFFFF_FFFF_1234_5678, ax=M64).ax == 0x1234_5678  # mov eax,edi: upper half cleared
    assert after("b86e000000", ax=M64).ax == 0x6E  # mov eax,0x6e (getppid's first)
    assert after("48c7c0ffffffff").ax == M64  # mov rax,-1: imm32 sign-extended
    assert after("48b88877665544332211").ax == 0x1122334455667788  # movabs rax,imm64
    assert after("88d8", ax=0x1111_1111_1111_1111, bx=0xAB).ax == 0x1111_1111_1111_11AB  # mov al,bl: a byte


def test_mov_load_rip_relative_reads_the_task_s_memory() -> None:
    # mov rax,[rip+0x100]: the address is the next instruction's plus the displacement
    mem = UserMem(bytes.fromhex("488b0500010000"))
    mem.put_u64(IP + 7 + 0x100, 0xDEAD_BEEF)
    r, _, done = run("", mem)
    assert done and r.ax == 0xDEAD_BEEF and r.ip == IP + 7


def test_mov_store_writes_through_base_index_scale_displacement() -> None:
    # mov [rsp+rcx*8+0x10],rax
    r, mem, done = run("488944cc10", ax=0x77, cx=2)
    assert done and mem.writes == [(SP + 2 * 8 + 0x10, (0x77).to_bytes(8, "little"))] and r.sp == SP


def test_lea_computes_without_touching_memory_or_flags() -> None:
    r = after("488d0437", di=10, si=32, flags=0x2 | ZF)  # lea rax,[rdi+rsi] (uprog's qpt_target)
    assert r.ax == 42 and r.flags == 0x2 | ZF
    r = after("8d4701", di=0xFFFF_FFFF_FFFF_FFFF)  # lea eax,[rdi+1]: 32 bits, zero-extended
    assert r.ax == 0


@pytest.mark.parametrize(
    ("code", "regs", "out", "flags"),
    [
        # sub rsp,0x10 (malloc's): 0x7fffffffe000 - 0x10 = 0x...dff0, no borrow out of the top or of the low
        # nibble (no CF, no AF), low byte 0xf0 with four bits set (PF)
        ("4883ec10", {}, ("sp", SP - 0x10), PF),
        # add rsp,0x18: 0x...e000 + 0x18 = 0x...e018 (two bits set in the low byte: PF)
        ("4883c418", {}, ("sp", SP + 0x18), PF),
        # sub rax,1 with rax=0: borrow (CF), -1 all ones (SF, PF), AF from bit 4's borrow
        ("4883e801", {"ax": 0}, ("ax", M64), CF | PF | AF | SF),
        # add eax,1 with eax=0x7fffffff: signed overflow into 0x80000000 (OF, SF), AF, PF (low byte 0)
        ("83c001", {"ax": 0x7FFF_FFFF}, ("ax", 0x8000_0000), OF | SF | AF | PF),
        # add rax,rbx: all ones + 1 = 0 with a carry out (CF, ZF, PF, AF)
        ("4801d8", {"ax": M64, "bx": 1}, ("ax", 0), CF | ZF | PF | AF),
        # xor eax,eax: 0 (ZF, PF), CF and OF cleared
        ("31c0", {"ax": 0x1234, "flags": 0x2 | CF | OF}, ("ax", 0), ZF | PF),
        # and ecx,0xf0 with ecx=0x1ff -> 0xf0 (four bits: PF)
        ("81e1f0000000", {"cx": 0x1FF}, ("cx", 0xF0), PF),
        # or rdx,rdx with rdx = 1<<63: SF, the low byte 0 (PF)
        ("4809d2", {"dx": 1 << 63}, ("dx", 1 << 63), SF | PF),
    ],
)
def test_arithmetic_results_and_flags(code: str, regs: dict[str, int], out: tuple[str, int], flags: int) -> None:
    r = after(code, **regs)
    assert getattr(r, out[0]) == out[1]
    assert r.flags & ARITH == flags
    assert r.flags & ~ARITH == regs.get("flags", 0x2) & ~ARITH  # the other flags stay


@pytest.mark.parametrize(
    ("code", "regs", "flags"),
    [
        ("4885ff", {"di": 0}, ZF | PF),  # test rdi,rdi with 0 (free's first)
        ("4885ff", {"di": 0x8000_0000_0000_0100}, SF | PF),  # negative, low byte 0
        ("4883fa10", {"dx": 0x0F}, CF | SF | PF),  # cmp rdx,0x10 (memcpy's): 0xf - 0x10 = -1, low nibble 0xf - 0
        ("4883fa10", {"dx": 0x10}, ZF | PF),
        ("4839c8", {"ax": 1 << 63, "cx": 1}, OF | PF | AF),  # cmp rax,rcx: INT64_MIN - 1 overflows
    ],
)
def test_compares_set_flags_and_write_nothing(code: str, regs: dict[str, int], flags: int) -> None:
    r, mem, done = run(code, **regs)
    assert done and r.flags & ARITH == flags and mem.writes == []
    for name, value in regs.items():
        assert getattr(r, name) == value


def test_cmp_byte_in_memory_with_zero() -> None:
    # cmp byte [rip+0x20],0 (write's and read's first): the byte 0 -> ZF and PF
    mem = UserMem(bytes.fromhex("803d2000000000"))
    FakeMem.write(mem, IP + 7 + 0x20, b"\x00")
    r, _, done = run("", mem)
    assert done and r.flags & ARITH == ZF | PF and r.ip == IP + 7


def test_branches_as_the_kernel_emulates_them() -> None:
    r, mem, done = run("e8fb0f0000")  # call .+0x1000 (rel32 0xffb from the next ip)
    assert done and r.ip == IP + 5 + 0xFFB and r.sp == SP - 8 and mem.u64(SP - 8) == IP + 5
    mem = UserMem(bytes.fromhex("c3"))
    mem.put_u64(SP, 0x4000_1234)
    r, _, done = run("", mem)  # ret
    assert done and r.ip == 0x4000_1234 and r.sp == SP + 8
    assert after("7405", flags=0x2 | ZF).ip == IP + 2 + 5  # je taken
    assert after("7405", flags=0x2).ip == IP + 2  # je not taken


@pytest.mark.parametrize(
    "code",
    [
        "0f05",  # syscall: the kernel's to run
        "66b80100",  # mov ax,1: a 16-bit operand
        "88e0",  # mov al,ah: a high byte
        "64488b042528000000",  # mov rax,fs:[0x28]: the fs base is not in pt_regs
        "678b07",  # mov eax,[edi]: a 32-bit address
        "fa",  # cli: faults in user mode
        "9c",  # pushf: not emulated for user tasks
        "f3a4",  # rep movsb
        "ff25f0ffffff",  # jmp [rip-0x10]: stepped, as the kernel's kprobes step it
        "66e80000",  # callw: 0x66 on a branch, which the kernel's uprobes refuse (Intel and AMD differ)
        "f0830001",  # lock add dword [rax],1: left to the CPU's atomic
        "48010424",  # add [rsp],rax: run again after a kill between its store and its ip, it would add twice
        "83642404fe",  # and dword [rsp+4],-2: the same for every read-modify-write of memory
    ],
)
def test_what_is_not_emulated_is_left_to_the_step(code: str) -> None:
    _r, mem, done = run(code)
    assert not done and mem.writes == []


def test_the_trap_flag_leaves_the_instruction_to_the_step() -> None:
    _r, _mem, done = run("90", flags=0x2 | TF)  # a debugger single-steps the task: its #DB comes after
    assert not done


def test_a_push_to_memory_the_task_cannot_write_is_stepped() -> None:
    mem = UserMem(bytes.fromhex("4154"))
    mem.denied.update(range(SP - 8, SP))
    _r, _, done = run("", mem)
    assert not done and mem.writes == []


def test_code_the_task_cannot_fetch_is_stepped() -> None:
    mem = UserMem(bytes.fromhex("90"))
    mem.denied.add(IP)
    assert not run("", mem)[2]


# Leaf page-table entries: present 0x1, RW 0x2, user 0x4, accessed 0x20, dirty 0x40, NX bit 63.
@pytest.mark.parametrize(
    ("entry", "read", "write", "fetch"),
    [
        (0x67, True, True, True),  # a dirty writable user page
        (0x27, True, False, True),  # writable but clean: the store would set D
        (0x65, True, False, True),  # read-only (copy-on-write)
        (0x63, False, False, False),  # a kernel page
        (0x66, False, False, False),  # not present
        (0x47, False, False, False),  # never accessed: the access would set A
        (0x67 | 1 << 63, True, True, False),  # NX
        (0x67 | 1 << 59, False, False, False),  # protection key 1
    ],
)
def test_user_page_allows_what_the_cpu_allows_without_setting_a_bit(entry: int, read: bool, write: bool,
                                                                     fetch: bool) -> None:  # fmt: skip
    got = tuple(UP.user_page_allows(entry, access) for access in ("read", "write", "fetch"))
    assert got == (read, write, fetch)


def test_an_ia32_task_s_instruction_is_stepped() -> None:
    # 0x55 is push ebp there (4 bytes), and 0x40-0x4f are inc/dec, not REX prefixes: nothing is performed.
    r, mem, done = run("55", cs=0x23, bp=0x1234)
    assert not done and r.ip == IP and r.sp == SP and mem.writes == []
