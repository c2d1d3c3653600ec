"""Which process a VM is: the listener behind a gdbstub address, named as (pid, start time)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from qprobe.vmm.peer import kernel_args, listener_pid, process_identity, qemu_kernel_args, still_running


def test_a_process_is_its_pid_and_start_time() -> None:
    me = process_identity(os.getpid())
    assert me is not None and still_running(me)
    assert not still_running((me[0], me[1] + 1))  # the same pid started at another time: another process
    child = subprocess.Popen(["true"])
    child.wait()
    assert process_identity(child.pid) is None  # reaped: no such process (pids are not reused this soon)


def test_the_listener_on_a_unix_socket_or_a_tcp_port(tmp_path: Path) -> None:
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(str(tmp_path / "gdb.sock"))
    assert listener_pid(str(tmp_path / "gdb.sock")) is None  # bound, not listening: no stub there
    unix.listen()
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    try:
        assert listener_pid(str(tmp_path / "gdb.sock")) == os.getpid()
        assert listener_pid(("127.0.0.1", tcp.getsockname()[1])) == os.getpid()
        assert listener_pid(("10.0.0.1", tcp.getsockname()[1])) is None  # that port on another machine
        assert listener_pid(str(tmp_path / "none.sock")) is None
    finally:
        unix.close()
        tcp.close()


def test_a_qemu_command_line_s_kernel_and_append() -> None:
    cwd = Path("/run/vm")
    argv = ["qemu-system-x86_64", "-S", "-kernel", "bzImage", "-append", "console=ttyS0 nokaslr", "-m", "1G"]
    assert kernel_args(argv, cwd) == (cwd / "bzImage", "console=ttyS0 nokaslr")
    # Two dashes as well as one; the last one given counts, as in QEMU; an absolute path stays so.
    argv = ["qemu", "--kernel", "old", "-append", "a", "-kernel", "/boot/vmlinuz", "--append", ""]
    assert kernel_args(argv, cwd) == (Path("/boot/vmlinuz"), "")
    assert kernel_args(["qemu", "-S", "-hda", "disk.img"], cwd) == (None, None)
    assert kernel_args(["qemu", "-kernel"], cwd) == (None, None)  # QEMU would refuse it: nothing to read
    # An option's value is never read as an option, whatever it looks like.
    assert kernel_args(["qemu", "-kernel", "bz", "-append", "-kernel", "-m", "1G"], cwd) == (cwd / "bz", "-kernel")


def test_a_qemu_process_s_kernel_is_read_from_its_command_line(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "print(flush=True); input()", "-kernel", "bz", "-append",
                              "quiet memmap=2M$0x1e000000"], cwd=tmp_path, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline() == b"\n"  # it runs, its command line set
        assert qemu_kernel_args(child.pid) == (tmp_path / "bz", "quiet memmap=2M$0x1e000000")
    finally:
        child.communicate(b"\n")
    assert qemu_kernel_args(child.pid) == (None, None)  # gone
