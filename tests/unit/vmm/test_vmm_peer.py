"""Which process a VM is: the listener behind a gdbstub address, named as (pid, start time)."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

from qprobe.vmm.peer import listener_pid, process_identity, still_running


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
        assert listener_pid(str(tmp_path / "none.sock")) is None
    finally:
        unix.close()
        tcp.close()
