"""The core's unit tests drive a real GdbRemote against tests/unit/vmm's scripted QEMU gdbstub."""

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vmm"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernel"))  # ifunc_library

from vmm_fakes import QemuStub

from qprobe.arch.x86_64.arch import X86_64
from qprobe.vmm.connection import Connection
from qprobe.vmm.gdbremote import GdbRemote


@pytest.fixture
def stub_gdb() -> Iterator[tuple[QemuStub, GdbRemote]]:
    """The scripted QEMU 7.2 gdbstub and a GdbRemote past its handshake; afterwards the stub saw no error."""
    stub = QemuStub()
    gdb = GdbRemote(Connection(stub.client, name="fake"))
    gdb.handshake()
    gdb.allow_g(X86_64.registers.plain)
    yield stub, gdb
    stub.close()
    assert not stub.errors, stub.errors
