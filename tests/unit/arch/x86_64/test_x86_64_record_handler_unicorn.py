"""The uprobe record handler runs on a real x86 CPU model (unicorn), called as the kernel's uprobes call it.

``handler(self, regs)`` and ``ret_handler(self, func, regs)`` are C functions
to the kernel: they must keep every callee-saved register, return 0, and
write the ring entry the host's drain decodes into the user registers the
kernel passed, the probe's id, and a return's function.
"""

from __future__ import annotations

import struct

import pytest

unicorn = pytest.importorskip("unicorn", reason="unicorn is not installed; it only cross-checks the arch layer")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from unicorn import x86_const as X  # noqa: E402

from qprobe.arch.guestram import PercpuLayout  # noqa: E402
from qprobe.arch.x86_64.detour import ENTRY_SIZE, R_HEAD, R_LOSSY, R_WAITS, RING_HEADER  # noqa: E402
from qprobe.arch.x86_64.guestram import X86GuestRam  # noqa: E402
from qprobe.arch.x86_64.ptregs import PT_REGS_ORDER, PT_REGS_SIZE  # noqa: E402

CODE, RESUME, PERCPU, TASK, RINGS, DATA, STACK = (0x10000000, 0x12000000, 0x20000000, 0x30000000, 0x40000000,
                                                  0x50000000, 0x60008000)  # fmt: skip
# The user pt_regs ends where the mapping does, as the kernel's stack does above it: a read past it faults.
LOST, COUNTER, REGS_AT = DATA, DATA + 0x10000, DATA + 0x100000 - PT_REGS_SIZE
CPU_NUMBER, CURRENT_TASK, PID_OFF, COMM_OFF = 0x100, 0x200, 0x980, 0xBB0
NCPUS, CPU, PID, PROBE_ID, ENTRIES, PORT = 2, 1, 4242, 77, 64, 0x504
CALLEE_SAVED = ("rbx", "rbp", "r12", "r13", "r14", "r15")
UC = {name: getattr(X, f"UC_X86_REG_{name.upper()}") for name in CALLEE_SAVED}
LAYOUTS = X86GuestRam()
USER = st.fixed_dictionaries({name: st.integers(0, 2**64 - 1) for name in PT_REGS_ORDER})


def machine(returns: bool, lossy_full: bool = False) -> unicorn.Uc:
    uc = unicorn.Uc(unicorn.UC_ARCH_X86, unicorn.UC_MODE_64)
    for base in (CODE, RESUME, PERCPU, TASK, RINGS, DATA):
        uc.mem_map(base, 0x100000)
    uc.mem_map(STACK - 0x8000, 0x10000)
    uc.mem_write(RESUME, b"\xf4")
    uc.msr_write(0xC0000101, PERCPU)  # GS base
    uc.mem_write(PERCPU + CPU_NUMBER, CPU.to_bytes(4, "little"))
    uc.mem_write(PERCPU + CURRENT_TASK, TASK.to_bytes(8, "little"))
    uc.mem_write(TASK + PID_OFF, PID.to_bytes(4, "little"))
    uc.mem_write(TASK + COMM_OFF, b"uprog".ljust(16, b"\0"))
    percpu = PercpuLayout(CPU_NUMBER, 0, CURRENT_TASK)
    code = LAYOUTS.build_record_handler(RINGS, NCPUS, ENTRIES, LOST, percpu, PID_OFF, COMM_OFF, PORT, PROBE_ID,
                                        COUNTER, returns, CODE)  # fmt: skip
    assert code[:4] == bytes.fromhex("f30f1efa")  # endbr64: the kernel calls it indirectly
    uc.mem_write(CODE, code)
    if lossy_full:
        header = RINGS + RING_HEADER * CPU
        uc.mem_write(header + R_HEAD, ENTRIES.to_bytes(8, "little"))
        uc.mem_write(header + R_LOSSY, (1).to_bytes(8, "little"))
    return uc


def call(uc: unicorn.Uc, user: dict[str, int], returns: bool, func: int = 0) -> None:
    """The kernel's call: the user pt_regs at REGS_AT, the arguments in rdi, rsi (rdx), a return address pushed."""
    uc.mem_write(REGS_AT, b"".join(user[name].to_bytes(8, "little") for name in PT_REGS_ORDER))
    uc.reg_write(X.UC_X86_REG_RDI, 0xFFFF_8880_1234_0000)
    uc.reg_write(X.UC_X86_REG_RSI, func if returns else REGS_AT)
    uc.reg_write(X.UC_X86_REG_RDX, REGS_AT if returns else 0)
    for i, name in enumerate(CALLEE_SAVED):
        uc.reg_write(UC[name], 0x1111 * (i + 1))
    uc.mem_write(STACK - 8, RESUME.to_bytes(8, "little"))
    uc.reg_write(X.UC_X86_REG_RSP, STACK - 8)
    uc.reg_write(X.UC_X86_REG_EFLAGS, 0x202)
    uc.emu_start(CODE, RESUME, count=10_000)
    assert uc.reg_read(X.UC_X86_REG_RIP) == RESUME and uc.reg_read(X.UC_X86_REG_RSP) == STACK
    assert uc.reg_read(X.UC_X86_REG_RAX) == 0 and uc.reg_read(X.UC_X86_REG_EFLAGS) & 0x200  # interrupts back on
    assert {name: uc.reg_read(UC[name]) for name in CALLEE_SAVED} == {
        name: 0x1111 * (i + 1) for i, name in enumerate(CALLEE_SAVED)
    }


def _u64(uc: unicorn.Uc, addr: int) -> int:
    return int(struct.unpack("<Q", uc.mem_read(addr, 8))[0])


@settings(max_examples=20, deadline=None)
@given(USER, st.booleans(), st.integers(0, 2**64 - 1))
def test_a_hit_is_one_entry_of_the_user_registers_as_the_drain_decodes_it(user: dict[str, int], returns: bool,
                                                                         func: int) -> None:  # fmt: skip
    uc = machine(returns)
    call(uc, user, returns, func)
    call(uc, user, returns, func)
    assert _u64(uc, COUNTER) == 2 and _u64(uc, RINGS + RING_HEADER * CPU + R_HEAD) == 2
    raw = bytes(uc.mem_read(RINGS + RING_HEADER * NCPUS + CPU * ENTRIES * ENTRY_SIZE, 2 * ENTRY_SIZE))
    for entry in LAYOUTS.parse_ring_entries(raw):
        assert entry.probe_id == PROBE_ID and entry.cpu == CPU and entry.pid == PID and entry.comm == "uprog"
        assert entry.task == TASK and entry.cycles != 0 and entry.func == (func if returns else 0)
        assert entry.values == {name: user[name] for name in entry.values} and "rip" in entry.values
        assert entry.sp == user["rsp"]
    assert _u64(uc, LOST + PROBE_ID * 8) == 0


def test_a_full_lossy_ring_counts_the_hit_and_its_lost_record() -> None:
    uc = machine(False, lossy_full=True)
    call(uc, dict.fromkeys(PT_REGS_ORDER, 7), False)
    header = RINGS + RING_HEADER * CPU
    assert _u64(uc, COUNTER) == 1 and _u64(uc, LOST + PROBE_ID * 8) == 1
    assert _u64(uc, header + R_HEAD) == ENTRIES and _u64(uc, header + R_WAITS) == 0
