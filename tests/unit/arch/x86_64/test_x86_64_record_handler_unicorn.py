"""The uprobe record handler runs on a real x86 CPU model (unicorn), at the kernel's addresses, called as the
kernel's uprobes call it.

``handler(self, regs)`` and ``ret_handler(self, func, regs)`` are C functions
to the kernel: they must keep every callee-saved register, return 0, and
write the ring entry the host's drain decodes into the user registers the
kernel passed, the probe's id, and a return's function.
"""

from __future__ import annotations

import pytest

pytest.importorskip("unicorn", reason="unicorn is not installed; it only cross-checks the arch layer")
from hypothesis import given, settings
from hypothesis import strategies as st
from kernelcpu_x86_64 import CALLEE_SAVED, KernelCpu

from qprobe.arch.guestram import PercpuLayout
from qprobe.arch.x86_64.detour import ENTRY_SIZE, R_HEAD, R_LOSSY, R_WAITS, RING_HEADER
from qprobe.arch.x86_64.guestram import X86GuestRam
from qprobe.arch.x86_64.ptregs import PT_REGS_ORDER, PT_REGS_SIZE
from qprobe.core.uguest import RECORD_CODE_MAX

SCRATCH, PERCPU, TASK, STACK = (
    0xFFFF_FFFF_C000_0000,
    0xFFFF_8880_1F00_0000,
    0xFFFF_8880_0200_0000,
    0xFFFF_C900_0001_0000,
)
CODE, RESUME, RINGS, LOST, COUNTER = SCRATCH, SCRATCH + 0x1000, SCRATCH + 0x10000, SCRATCH + 0x2000, SCRATCH + 0x3000
# The user pt_regs ends where the stack's mapping does, as at the top of a task's kernel stack: a read past it faults.
REGS_AT = STACK + 0x1000 - PT_REGS_SIZE
CPU_NUMBER, CURRENT_TASK, PID_OFF, COMM_OFF = 0x100, 0x200, 0x980, 0xBB0
NCPUS, CPU, PID, PROBE_ID, ENTRIES, PORT = 2, 1, 4242, 77, 64, 0x504
LAYOUTS = X86GuestRam()
USER = st.fixed_dictionaries({name: st.integers(0, 2**64 - 1) for name in PT_REGS_ORDER})


def machine(returns: bool, lossy_full: bool = False) -> KernelCpu:
    cpu = KernelCpu([(SCRATCH, 0x40000), (PERCPU, 0x1000), (TASK, 0x1000), (STACK - 0x1000, 0x2000)], PERCPU)
    cpu.write(RESUME, b"\xf4")
    cpu.write(PERCPU + CPU_NUMBER, CPU.to_bytes(4, "little"))
    cpu.write(PERCPU + CURRENT_TASK, TASK.to_bytes(8, "little"))
    cpu.write(TASK + PID_OFF, PID.to_bytes(4, "little"))
    cpu.write(TASK + COMM_OFF, b"uprog".ljust(16, b"\0"))
    percpu = PercpuLayout(CPU_NUMBER, 0, CURRENT_TASK)
    code = LAYOUTS.build_record_handler(RINGS, NCPUS, ENTRIES, LOST, percpu, PID_OFF, COMM_OFF, PORT, PROBE_ID,
                                        COUNTER, returns, CODE)  # fmt: skip
    assert code[:4] == bytes.fromhex("f30f1efa")  # endbr64: the kernel calls it indirectly
    assert len(code) <= RECORD_CODE_MAX  # what GuestUprobes allocates for it
    cpu.write(CODE, code)
    if lossy_full:
        header = RINGS + RING_HEADER * CPU
        cpu.write(header + R_HEAD, ENTRIES.to_bytes(8, "little"))
        cpu.write(header + R_LOSSY, (1).to_bytes(8, "little"))
    return cpu


def call(cpu: KernelCpu, user: dict[str, int], returns: bool, func: int = 0) -> None:
    """The kernel's call: the user pt_regs at REGS_AT, the arguments in rdi, rsi (rdx), a return address pushed."""
    cpu.write(REGS_AT, b"".join(user[name].to_bytes(8, "little") for name in PT_REGS_ORDER))
    cpu.reg("rdi", 0xFFFF_8880_1234_0000)
    cpu.reg("rsi", func if returns else REGS_AT)
    cpu.reg("rdx", REGS_AT if returns else 0)
    kept = {name: 0x1111 * (i + 1) for i, name in enumerate(CALLEE_SAVED)}
    for name, value in kept.items():
        cpu.reg(name, value)
    cpu.reg("eflags", 0x202)
    sp = STACK - 0x100
    cpu.write(sp, RESUME.to_bytes(8, "little"))
    cpu.call(CODE, sp, RESUME)
    assert cpu.reg("rsp") == sp + 8 and cpu.reg("rax") == 0 and cpu.reg("eflags") & 0x200  # interrupts back on
    assert cpu.regs(CALLEE_SAVED) == kept


@settings(max_examples=20, deadline=None)
@given(USER, st.booleans(), st.integers(0, 2**64 - 1))
def test_a_hit_is_one_entry_of_the_user_registers_as_the_drain_decodes_it(user: dict[str, int], returns: bool,
                                                                         func: int) -> None:  # fmt: skip
    cpu = machine(returns)
    call(cpu, user, returns, func)
    call(cpu, user, returns, func)
    assert cpu.word(COUNTER) == 2 and cpu.word(RINGS + RING_HEADER * CPU + R_HEAD) == 2
    raw = cpu.read(RINGS + RING_HEADER * NCPUS + CPU * ENTRIES * ENTRY_SIZE, 2 * ENTRY_SIZE)
    for entry in LAYOUTS.parse_ring_entries(raw):
        assert entry.probe_id == PROBE_ID and entry.cpu == CPU and entry.pid == PID and entry.comm == "uprog"
        assert entry.task == TASK and entry.cycles != 0 and entry.func == (func if returns else 0)
        assert entry.values == {name: user[name] for name in entry.values} and "rip" in entry.values
        assert entry.sp == user["rsp"]
    assert cpu.word(LOST + PROBE_ID * 8) == 0


def test_a_full_lossy_ring_counts_the_hit_and_its_lost_record() -> None:
    cpu = machine(False, lossy_full=True)
    call(cpu, dict.fromkeys(PT_REGS_ORDER, 7), False)
    header = RINGS + RING_HEADER * CPU
    assert cpu.word(COUNTER) == 1 and cpu.word(LOST + PROBE_ID * 8) == 1
    assert cpu.word(header + R_HEAD) == ENTRIES and cpu.word(header + R_WAITS) == 0
