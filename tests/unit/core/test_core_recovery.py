"""Recovery (qprobe.core.recovery) of a guest an earlier qprobe left with probes armed, on the scripted gdbstub.

The journal is a real one (in a private cache directory); the vCPUs, guest
memory and the stub's replies are tests/unit/vmm's QEMU 7.2 fake.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from vmm_fakes import QemuStub, g_offsets

from qprobe.arch.x86_64 import detour, retdetour
from qprobe.arch.x86_64.arch import X86_64
from qprobe.arch.x86_64.ptregs import PT_REGS_ORDER
from qprobe.core.recovery import _Recovery, recover
from qprobe.vmm.gdbremote import GdbRemote
from qprobe.vmm.journal import Journal, JournalError, Patch
from qprobe.vmm.scratch import SIZE as SCRATCH_SIZE

ARCH = X86_64()
ENTRY = 0xFFFF_FFFF_81C0_0BA0  # asm_exc_int3
PROBE, PROBE_PHYS = 0xFFFF_FFFF_8120_0000, 0x0120_0000
SLOT = 0xFFFF_FFFF_A000_0000
STACK = 0xFFFF_C900_0000_3F00
CONTEXT_SP = 0xFFFF_C900_0000_3FA0
FLAGS = 0x246
SCRATCH, SCRATCH_PHYS = 0xFFFF_FFFF_A000_0000, 0x1E00_0000


class FakeMem:
    """Kernel virtual memory over the stub's memory (one flat space: the addresses never overlap here)."""

    def __init__(self, stub: QemuStub) -> None:
        self.stub = stub

    def read(self, addr: int, size: int, pgd: int | None = None) -> bytes:
        return self.stub.read(addr, size)

    def read_u64(self, addr: int) -> int:
        return int.from_bytes(self.read(addr, 8), "little")

    def virt_to_phys(self, addr: int, pgd: int | None = None) -> int:
        return addr


class FakeSymbols:
    def __contains__(self, name: str) -> bool:
        return name == "asm_exc_int3"

    def address(self, name: str) -> int:
        return ENTRY

    def lookup(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(addr=ENTRY, size=0x40)


@dataclass
class Rig:
    stub: QemuStub
    gdb: GdbRemote
    kernel: SimpleNamespace
    journal: Journal

    def reg(self, name: str, cpu: int) -> int:
        off = g_offsets()[name]
        return int.from_bytes(self.stub.vcpus[cpu].regs[off : off + (4 if name == "eflags" else 8)], "little")

    def left(self, *patches: Patch, **meta: int) -> Journal:
        """What a qprobe that died would have left: its journal, as the next one loads it."""
        for p in patches:
            self.journal.record(p)
        self.journal.set_meta(**meta)
        return Journal(self.journal.identity)


@pytest.fixture
def rig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stub_gdb: tuple[QemuStub, GdbRemote]) -> Rig:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("QPROBE_CACHE", str(cache))
    stub, gdb = stub_gdb
    kernel = SimpleNamespace(symbols=FakeSymbols(), mem=FakeMem(stub))
    for i in range(len(stub.vcpus)):
        stub.vcpus[i].set("rip", 0xFFFF_FFFF_8100_0000)
    return Rig(stub, gdb, kernel, Journal("test-vm"))


def int3_patch() -> Patch:
    return Patch(PROBE_PHYS, PROBE, b"\x55", b"\xcc", "int3", SLOT)


def test_a_trapped_vcpu_and_one_in_a_boosted_slot_go_back_to_the_text(rig: Rig) -> None:
    rig.stub.fill(PROBE_PHYS, b"\xcc")
    # vCPU 0 took the int3 and sits on the #BP entry, its exception frame on the stack.
    rig.stub.fill(STACK, struct.pack("<5Q", PROBE + 1, 0x10, FLAGS, CONTEXT_SP, 0x18))
    rig.stub.vcpus[0].set("rip", ENTRY)
    rig.stub.vcpus[0].set("rsp", STACK)
    # vCPU 1 was running the boosted copy of the instruction in its slot.
    rig.stub.vcpus[1].set("rip", SLOT + 1)
    journal = rig.left(int3_patch())
    assert recover(rig.gdb, rig.kernel, ARCH, journal) == 1  # type: ignore[arg-type]
    assert rig.stub.read(PROBE_PHYS, 1) == b"\x55"
    assert (rig.reg("rip", 0), rig.reg("rsp", 0), rig.reg("eflags", 0)) == (PROBE, CONTEXT_SP, FLAGS)
    assert rig.reg("rip", 1) == PROBE + 1
    assert not journal.path.exists()


def test_vcpus_part_way_into_a_trap_step_go_on_past_the_instruction_with_their_if_back(rig: Rig) -> None:
    rig.stub.fill(PROBE_PHYS, b"\xcc")
    # vCPU 0 ran the copy for a context with interrupts on (slot + 48) and took the int3 after it.
    rig.stub.fill(STACK, struct.pack("<5Q", SLOT + 48 + 1 + 1, 0x10, FLAGS & ~0x200, CONTEXT_SP - 8, 0x18))
    rig.stub.vcpus[0].set("rip", ENTRY)
    rig.stub.vcpus[0].set("rsp", STACK)
    # vCPU 1 is about to run the copy for a context with interrupts off (slot + 32).
    rig.stub.vcpus[1].set("rip", SLOT + 32)
    rig.stub.vcpus[1].set("eflags", 0x46)
    journal = rig.left(int3_patch())
    assert recover(rig.gdb, rig.kernel, ARCH, journal) == 1  # type: ignore[arg-type]
    assert (rig.reg("rip", 0), rig.reg("rsp", 0), rig.reg("eflags", 0)) == (PROBE + 1, CONTEXT_SP - 8, FLAGS)
    assert (rig.reg("rip", 1), rig.reg("eflags", 1)) == (PROBE, 0x46)


def test_a_return_into_the_trampoline_goes_to_the_real_return_address(rig: Rig) -> None:
    tramp, slot, real = SCRATCH + 0x100, CONTEXT_SP - 8, 0xFFFF_FFFF_8130_0042
    rig.stub.fill(slot, tramp.to_bytes(8, "little"))
    rig.stub.vcpus[0].set("rip", tramp)  # the ret consumed the slot: rsp is just past it
    rig.stub.vcpus[0].set("rsp", CONTEXT_SP)
    journal = rig.left(Patch(slot, slot, real.to_bytes(8, "little"), tramp.to_bytes(8, "little"), "retaddr"))
    recover(rig.gdb, rig.kernel, ARCH, journal)  # type: ignore[arg-type]
    assert rig.reg("rip", 0) == real
    assert rig.stub.read(slot, 8) == real.to_bytes(8, "little")  # what a later ret would find


def retaddr_patch(tramp: int, real: int) -> Patch:
    slot = CONTEXT_SP - 8
    return Patch(slot, slot, real.to_bytes(8, "little"), tramp.to_bytes(8, "little"), "retaddr")


def test_a_return_trapped_on_the_doorbell_trampolines_int3_goes_to_the_real_return_address(rig: Rig) -> None:
    # push 0; call stub; int3: the int3 after the call is where a return whose mailbox was busy traps.
    tramp, real = SCRATCH + 0x100, 0xFFFF_FFFF_8130_0042
    int3 = tramp + len(ARCH.guest_ram.return_trampoline(tramp, SCRATCH)) - 1  # type: ignore[union-attr]
    rig.stub.fill(STACK, struct.pack("<5Q", int3 + 1, 0x10, FLAGS, CONTEXT_SP, 0x18))
    rig.stub.vcpus[0].set("rip", ENTRY)
    rig.stub.vcpus[0].set("rsp", STACK)
    r = _Recovery(rig.gdb, rig.kernel, ARCH, [retaddr_patch(tramp, real)], {})  # type: ignore[arg-type]
    r.rewind(rig.gdb.threads()[0])
    assert (rig.reg("rip", 0), rig.reg("rsp", 0), rig.reg("eflags", 0)) == (real, CONTEXT_SP, FLAGS)


def test_a_return_trapped_on_the_trampoline_under_the_watchpoint_hook_goes_to_the_real_return_address(
    rig: Rig,
) -> None:
    """Stopped inside poke_int3_handler with the trap's pt_regs at rdi: the context goes on, its registers back."""
    tramp, real, safe, ptregs = SCRATCH + 0x100, 0xFFFF_FFFF_8130_0042, ENTRY + 0x40, STACK - 0x200
    values = dict.fromkeys(PT_REGS_ORDER, 0) | {"rax": 0xA, "rbx": 0xB0B, "rip": tramp + 1, "cs": 0x10,
                                                 "eflags": FLAGS, "rsp": CONTEXT_SP, "ss": 0x18}  # fmt: skip
    rig.stub.fill(ptregs, struct.pack(f"<{len(PT_REGS_ORDER)}Q", *(values[n] for n in PT_REGS_ORDER)))
    for name, value in (("rip", safe), ("rdi", ptregs), ("rbx", 1)):
        rig.stub.vcpus[0].set(name, value)
    r = _Recovery(rig.gdb, rig.kernel, ARCH, [retaddr_patch(tramp, real)], {})  # type: ignore[arg-type]
    r.watch_safe = frozenset({safe})
    r.rewind(rig.gdb.threads()[0])
    assert (rig.reg("rip", 0), rig.reg("rsp", 0), rig.reg("eflags", 0)) == (real, CONTEXT_SP, FLAGS)
    assert (rig.reg("rax", 0), rig.reg("rbx", 0)) == (0xA, 0xB0B)


def test_a_vcpu_found_in_a_slot_while_the_area_is_emptied_goes_back_to_the_text(rig: Rig) -> None:
    # Back in a trap-step's copy after the text was restored (an exception taken there returned): a step
    # would run it on into the int3 after it, which nothing handles any more.
    slot = SCRATCH + SCRATCH_SIZE - 64  # the area's last slot: any step leaves the area at once
    rig.stub.vcpus[1].set("rip", slot + 32)
    rig.stub.vcpus[1].set("eflags", 0x46)
    pmd = Patch(0x1000, SCRATCH, bytes(8), b"\x01" * 8, "pmd")
    probe = Patch(PROBE_PHYS, PROBE, b"\x55", b"\xcc", "int3", slot)
    r = _Recovery(rig.gdb, rig.kernel, ARCH, [probe, pmd], {})  # type: ignore[arg-type]
    r.evacuate(rig.gdb.threads()[1], 1)
    assert (rig.reg("rip", 1), rig.reg("eflags", 1)) == (PROBE, 0x46)
    assert not rig.stub.sent(b"vCont;s")


def test_a_journal_that_does_not_match_the_guest_is_refused_untouched(rig: Rig) -> None:
    rig.stub.fill(PROBE_PHYS, b"\x90")  # neither qprobe's int3 nor the original byte
    rig.stub.vcpus[1].set("rip", SLOT + 1)
    journal = rig.left(int3_patch())
    with pytest.raises(JournalError, match="does not match this guest"):
        recover(rig.gdb, rig.kernel, ARCH, journal)  # type: ignore[arg-type]
    assert rig.stub.read(PROBE_PHYS, 1) == b"\x90" and rig.reg("rip", 1) == SLOT + 1
    assert not rig.stub.sent(b"P")


def mailbox(rig: Rig, cpu: int, probe_id: int, frame: int, cont: int) -> int:
    """A request in CPU ``cpu``'s mailbox as the stub leaves it; the mailbox's physical address."""
    mb = SCRATCH_PHYS + 0x1000 + cpu * detour.MAILBOX_SIZE
    rig.stub.fill(mb, bytes(detour.MAILBOX_SIZE))
    rig.stub.fill(mb + detour.MB_FRAME, frame.to_bytes(8, "little"))
    rig.stub.fill(mb + detour.MB_REGS + detour.FRAME_RET, cont.to_bytes(8, "little"))
    rig.stub.fill(mb + detour.MB_REGS + detour.FRAME_ID, probe_id.to_bytes(8, "little"))
    rig.stub.fill(mb + detour.MB_STATE, detour.STATE_REQUEST.to_bytes(8, "little"))
    return mb


def answer(rig: Rig, mb: int) -> tuple[int, int, int]:
    ip, sp = struct.unpack("<2Q", rig.stub.read(mb + detour.MB_FINAL_IP, 16))
    return int.from_bytes(rig.stub.read(mb + detour.MB_STATE, 8), "little"), ip, sp


def test_a_vcpu_waiting_in_the_mailbox_stub_is_released_past_its_detour(rig: Rig) -> None:
    meta = {"scratch": SCRATCH, "scratch_phys": SCRATCH_PHYS, "mailboxes": SCRATCH + 0x1000}
    frame, cont = CONTEXT_SP - detour.FRAME_SIZE, SCRATCH + 0x2010
    mb = mailbox(rig, 1, 7, frame, cont)
    r = _Recovery(rig.gdb, rig.kernel, ARCH, [], meta)  # type: ignore[arg-type]
    r.answer_mailbox(1)
    assert answer(rig, mb) == (detour.STATE_DONE, cont, CONTEXT_SP)
    r.answer_mailbox(1)  # answered once: nothing more is written
    assert answer(rig, mb) == (detour.STATE_DONE, cont, CONTEXT_SP)


def test_a_return_waiting_in_the_mailbox_resumes_at_its_instances_return_address(rig: Rig) -> None:
    instances, real = SCRATCH + 0x4000, 0xFFFF_FFFF_8130_0042
    meta = {"scratch": SCRATCH, "scratch_phys": SCRATCH_PHYS, "mailboxes": SCRATCH + 0x1000,
            "instances": instances, "ninstances": 4, "ret_trampolines": SCRATCH + 0x6000}  # fmt: skip
    frame = CONTEXT_SP - detour.FRAME_SIZE  # the return's stack slot is the word below the context's sp
    rig.stub.fill(SCRATCH_PHYS + 0x4000, bytes(4 * retdetour.INSTANCE_SIZE))
    rig.stub.fill(SCRATCH_PHYS + 0x4000 + 2 * retdetour.INSTANCE_SIZE, struct.pack("<2Q", CONTEXT_SP - 8, real))
    mb = mailbox(rig, 0, retdetour.TRAMPOLINE_ID, frame, SCRATCH + 0x7000)
    r = _Recovery(rig.gdb, rig.kernel, ARCH, [], meta)  # type: ignore[arg-type]
    assert r.guest == {CONTEXT_SP - 8: (SCRATCH + 0x6000 + 2 * retdetour.TRAMP_STRIDE, real)}
    r.answer_mailbox(0)
    assert answer(rig, mb) == (detour.STATE_DONE, real, CONTEXT_SP)
