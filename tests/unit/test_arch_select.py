"""Which Arch a target gets: by the architecture its gdbstub reports (or its vmlinux's ELF machine), else one line."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "vmm"))

from vmm_fakes import QemuStub

from qprobe.arch.select import ARCHES, arch_named, arch_of_machine
from qprobe.arch.x86_64.arch import X86_64
from qprobe.errors import QprobeError, TargetError
from qprobe.vmm.connection import Connection
from qprobe.vmm.gdbremote import GdbRemote
from qprobe.wiring import arch_of


def connected(stub: QemuStub) -> GdbRemote:
    gdb = GdbRemote(Connection(stub.client, name="fake"))
    gdb.handshake()
    return gdb


@pytest.fixture
def stub() -> Iterator[QemuStub]:
    s = QemuStub()
    yield s
    s.close()


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert text and "\n" not in text, text
    return text


def test_qemu_s_x86_64_description_gives_x86_64(stub: QemuStub) -> None:
    assert isinstance(arch_of(connected(stub)), X86_64)


def test_every_arch_is_found_by_its_name_and_its_elf_machine() -> None:
    for name, (machine, make) in ARCHES.items():
        assert arch_named(name).name == make().name == arch_of_machine(machine).name
        assert make().gdb_architecture == name


@pytest.mark.parametrize("xml", [b"<architecture>riscv:rv64</architecture>", b""])
def test_another_or_no_architecture_is_refused_in_one_line(stub: QemuStub, xml: bytes) -> None:
    stub.annexes["target.xml"] = stub.annexes["target.xml"].replace(b"<architecture>i386:x86-64</architecture>", xml)
    with pytest.raises(TargetError) as info:
        arch_of(connected(stub))
    assert ("riscv:rv64" if xml else "names no architecture") in one_line(info.value)


def test_a_description_without_the_arch_s_registers_is_refused(stub: QemuStub) -> None:
    """QEMU's user-mode x86_64 stub says i386:x86-64 but has no control registers: not a system target."""
    stub.annexes["i386-64bit.xml"] = stub.annexes["i386-64bit.xml"].replace(b'name="cr3"', b'name="cr9"')
    with pytest.raises(TargetError) as info:
        arch_of(connected(stub))
    assert "cr3" in one_line(info.value)


def test_an_unsupported_elf_machine_is_one_line() -> None:
    with pytest.raises(QprobeError) as info:
        arch_of_machine(243)  # EM_RISCV
    assert "ELF machine 243" in one_line(info.value)
