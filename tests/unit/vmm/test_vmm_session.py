"""What `qprobe attach unix:PATH` trusts: the session file beside the socket is checked before its RAM file
is mapped writable, and a second qprobe on the same gdbstub is told at once that one is attached."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import qprobe.session
from qprobe.errors import TargetError
from qprobe.vmm.connection import Connection, claim
from qprobe.vmm.qemu import SHM_PREFIX, SHM_ROOT

RAM_SIZE = 1 << 20


@pytest.fixture
def run(tmp_path: Path) -> Iterator[tuple[Path, dict[str, object]]]:
    """A run directory as `qprobe boot` leaves it (a listening gdb socket, session.json) and its RAM file."""
    rundir = tmp_path / "qprobe-run-test"
    rundir.mkdir(mode=0o700)
    shm = Path(tempfile.mkdtemp(prefix=SHM_PREFIX, dir=SHM_ROOT))
    (shm / "ram").write_bytes(bytes(RAM_SIZE))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(rundir / "gdb.sock"))
    listener.listen()
    for name in ("console.sock", "shell.sock", "doorbell.sock", "console.log"):
        (rundir / name).write_text("")
    session = {"gdb": str(rundir / "gdb.sock"), "console": str(rundir / "console.sock"),
               "shell": str(rundir / "shell.sock"), "ram": str(shm / "ram"),
               "ram_size": RAM_SIZE, "vmlinux": "/nonexistent/vmlinux", "image": "test", "pid": 1,
               "console_log": str(rundir / "console.log"), "doorbell": str(rundir / "doorbell.sock")}  # fmt: skip
    write(rundir, session)
    yield rundir, session
    listener.close()
    shutil.rmtree(shm)


def write(rundir: Path, session: dict[str, object] | str) -> None:
    path = rundir / "session.json"
    path.write_text(session if isinstance(session, str) else json.dumps(session))
    path.chmod(0o600)


def test_a_good_session_file_is_read(run: tuple[Path, dict[str, object]]) -> None:
    rundir, session = run
    assert qprobe.session.read_session(rundir / "gdb.sock") == session


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"ram": "/home/victim/file"}, "not one qprobe makes"),
        ({"ram": "/dev/shm/other/ram"}, "not one qprobe makes"),
        ({"ram_size": 2 * RAM_SIZE}, "not yours, not private or not"),
        ({"ram_size": "1M"}, "a number ram_size"),
        ({"ram_size": True}, "a number ram_size"),
        ({"vmlinux": None}, "needs strings"),
        ({"console": "/tmp/elsewhere/console.sock"}, "its console is not beside gdb.sock"),
        ({"doorbell": "/nonexistent/doorbell.sock"}, "its doorbell is not beside gdb.sock"),
    ],
)
def test_a_session_file_naming_what_qprobe_would_not_is_refused(
    run: tuple[Path, dict[str, object]], change: dict[str, object], message: str
) -> None:
    rundir, session = run
    write(rundir, {**session, **change})
    with pytest.raises(TargetError, match=message) as e:
        qprobe.attach(f"unix:{rundir / 'gdb.sock'}")
    assert "is not a session file qprobe wrote" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("text", ["{", "[]", '{"ram_size": Infinity}', "[" * 100_000])
def test_a_session_file_that_is_not_one_is_refused(run: tuple[Path, dict[str, object]], text: str) -> None:
    rundir, _ = run
    write(rundir, text)
    with pytest.raises(TargetError, match="is not a session file qprobe wrote"):
        qprobe.attach(f"unix:{rundir / 'gdb.sock'}")


def test_a_ram_file_that_is_a_link_or_a_session_file_others_can_write_is_refused(
    run: tuple[Path, dict[str, object]], tmp_path: Path
) -> None:
    rundir, session = run
    (rundir / "session.json").chmod(0o666)
    with pytest.raises(TargetError, match="not private to you"):
        qprobe.attach(f"unix:{rundir / 'gdb.sock'}")
    (rundir / "session.json").chmod(0o600)
    ram = Path(str(session["ram"]))
    victim = tmp_path / "victim"
    victim.write_bytes(bytes(RAM_SIZE))
    ram.unlink()
    ram.symlink_to(victim)
    with pytest.raises(TargetError, match="not yours, not private"):
        qprobe.attach(f"unix:{rundir / 'gdb.sock'}")


def test_a_second_qprobe_on_one_gdbstub_is_told_at_once(run: tuple[Path, dict[str, object]]) -> None:
    rundir, _ = run
    first = Connection.open(f"unix:{rundir / 'gdb.sock'}")
    with pytest.raises(TargetError, match=r"another qprobe is attached to .*gdb\.sock"):
        Connection.open(f"unix:{rundir / 'gdb.sock'}")
    first.close()
    Connection.open(f"unix:{rundir / 'gdb.sock'}").close()  # released with the connection


def test_no_lock_is_made_beside_a_socket_in_a_directory_that_is_not_private(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    assert claim(str(tmp_path / "gdb.sock")) is None
    assert not os.listdir(tmp_path)
