"""A VM never outlives its owner: PR_SET_PDEATHSIG, the janitor, the sweep of stale directories.

The "QEMU" here is a stand-in program that sleeps: what is tested is the
lifetime machinery around any child, not QEMU (tests/vm/test_lifetime.py
does that with the real one).
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from qprobe.errors import TargetError
from qprobe.vmm import qemu as qemu_mod
from qprobe.vmm.qemu import QemuConfig, QemuProcess, sweep_stale

ROOT = Path(__file__).resolve().parents[3]
JANITOR = ROOT / "qprobe" / "vmm" / "janitor.py"


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture
def fake_qemu(tmp_path: Path) -> Path:
    """An executable that stands for QEMU: it ignores its arguments and sleeps."""
    exe = tmp_path / "fake-qemu"
    exe.write_text("#!/bin/sh\nexec sleep 1000\n")
    exe.chmod(0o755)
    return exe


@pytest.fixture
def private_roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """Run directories and the 'RAM' directory under tmp_path, so the test sees only its own."""
    run, shm = tmp_path / "run", tmp_path / "shm"
    run.mkdir()
    shm.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(run))
    monkeypatch.setattr(qemu_mod, "SHM_ROOT", shm)
    return run, shm


# -- the owner dies ---------------------------------------------------------------------------

OWNER = textwrap.dedent("""
    import sys, tempfile, time
    from pathlib import Path
    from qprobe.vmm import qemu
    tempfile.tempdir = sys.argv[1]
    qemu.SHM_ROOT = Path(sys.argv[2])
    q = qemu.QemuProcess(qemu.QemuConfig(kernel=Path(sys.argv[3])), qemu_binary=sys.argv[4],
                         keepable=sys.argv[5] == "keepable")
    if sys.argv[6] == "keep":
        q.keep()
    if sys.argv[6] == "journal":
        q.remove_with_vm([Path(p) for p in sys.argv[7:]])
    print(q.proc.pid, q.rundir, q.shmdir, flush=True)
    time.sleep(1000)
""")


def start_owner(
    tmp_path: Path, roots: tuple[Path, Path], fake: Path, *flags: str
) -> tuple[subprocess.Popen[str], int, Path, Path]:
    kernel = tmp_path / "bzImage"
    kernel.write_bytes(b"")
    argv = [sys.executable, "-c", OWNER, str(roots[0]), str(roots[1]), str(kernel), str(fake), *flags]
    owner = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert owner.stdout is not None
    pid, rundir, shmdir = owner.stdout.readline().split()
    return owner, int(pid), Path(rundir), Path(shmdir)


@pytest.mark.parametrize("flags", [("owned", "run"), ("keepable", "run")], ids=["owned", "keepable"])
def test_sigkill_of_the_owner_stops_qemu_and_removes_its_files(tmp_path: Path, fake_qemu: Path,
                                                               private_roots: tuple[Path, Path],
                                                               flags: tuple[str, str]) -> None:  # fmt: skip
    owner, pid, rundir, shmdir = start_owner(tmp_path, private_roots, fake_qemu, *flags)
    assert rundir.is_dir() and shmdir.is_dir() and not gone(pid)
    owner.kill()
    owner.wait()
    assert wait_until(lambda: gone(pid)), "the VM outlived its owner"
    assert wait_until(lambda: not rundir.exists() and not shmdir.exists()), "files left behind"


def test_sigkill_of_the_owner_removes_the_journal_of_its_vm(tmp_path: Path, fake_qemu: Path,
                                                             private_roots: tuple[Path, Path]) -> None:  # fmt: skip
    """An undo journal is of no use once its VM is gone: the janitor removes what the owner named."""
    journal, log = tmp_path / "vm.json", tmp_path / "vm.log"
    journal.write_text("{}")
    log.write_text("=vm\n")
    owner, pid, rundir, _ = start_owner(tmp_path, private_roots, fake_qemu, "owned", "journal", str(journal),
                                        str(log), str(tmp_path / "vm.tmp"))  # fmt: skip
    owner.kill()
    owner.wait()
    assert wait_until(lambda: gone(pid) and not rundir.exists())
    assert wait_until(lambda: not journal.exists() and not log.exists()), "the journal outlived its VM"


def test_pdeathsig_alone_stops_qemu(tmp_path: Path, fake_qemu: Path, private_roots: tuple[Path, Path]) -> None:
    owner, pid, rundir, _ = start_owner(tmp_path, private_roots, fake_qemu, "owned", "run")
    janitors = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _is_janitor_of(p, rundir)]
    assert len(janitors) == 1
    os.kill(int(janitors[0].name), signal.SIGKILL)  # no janitor: only the kernel's death signal is left
    owner.kill()
    owner.wait()
    assert wait_until(lambda: gone(pid)), "QEMU survived its owner without PR_SET_PDEATHSIG"


def _is_janitor_of(proc: Path, rundir: Path) -> bool:
    try:
        argv = (proc / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return str(JANITOR).encode() in argv and str(rundir).encode() in argv


def test_a_kept_vm_outlives_its_owner(tmp_path: Path, fake_qemu: Path, private_roots: tuple[Path, Path]) -> None:
    owner, pid, rundir, shmdir = start_owner(tmp_path, private_roots, fake_qemu, "keepable", "keep")
    try:
        owner.kill()
        owner.wait()
        time.sleep(0.5)  # what would have killed it (janitor, death signal) acts within milliseconds
        assert not gone(pid) and rundir.is_dir() and shmdir.is_dir()
    finally:
        os.kill(pid, signal.SIGKILL)


def test_terminate_stops_qemu_and_the_janitor(tmp_path: Path, fake_qemu: Path,
                                              private_roots: tuple[Path, Path]) -> None:  # fmt: skip
    kernel = tmp_path / "bzImage"
    kernel.write_bytes(b"")
    q = QemuProcess(QemuConfig(kernel=kernel), qemu_binary=str(fake_qemu))
    janitor = q._janitor
    assert janitor is not None and janitor.poll() is None
    q.terminate(timeout=1.0)
    assert janitor.poll() is not None and not q.alive()
    assert not q.rundir.exists() and not q.shmdir.exists()
    q.terminate()  # twice is harmless


# A QEMU whose main loop is stuck (spinning in a blocking write to a gdb client that stopped reading):
# its monitor socket accepts a connection but never greets, and SIGTERM, which QEMU handles in that same
# loop, does nothing.
STUCK_QEMU = textwrap.dedent("""
    import signal, socket, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    path = next(a.split("path=")[1].split(",")[0] for a in sys.argv if a.startswith("socket,id=qmp0,"))
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(4)
    held = []
    while True:
        held.append(server.accept()[0])  # never a greeting
""")


def test_terminate_stops_a_qemu_whose_monitor_never_answers(tmp_path: Path, private_roots: tuple[Path, Path]) -> None:
    stuck = tmp_path / "stuck-qemu"
    stuck.write_text(f"#!{sys.executable}\n{STUCK_QEMU}")
    stuck.chmod(0o755)
    kernel = tmp_path / "bzImage"
    kernel.write_bytes(b"")
    q = QemuProcess(QemuConfig(kernel=kernel), qemu_binary=str(stuck))
    assert wait_until(q.qmp_path.exists)
    asked: list[BaseException] = []

    def ask() -> None:
        try:
            q.qmp("query-status", timeout=0.2)
        except BaseException as exc:
            asked.append(exc)

    for step in (ask, q.terminate):
        thread = threading.Thread(target=step, daemon=True)
        thread.start()
        thread.join(60)  # a guard against the hang this test is about, not a speed target
        assert not thread.is_alive(), f"{step.__name__}() waited for a monitor that never answers"
    assert isinstance(asked[0], TargetError) and "did not answer 'query-status'" in str(asked[0])
    assert not q.alive() and not q.rundir.exists()


def test_tcg_thread_mode_reaches_the_command_line(tmp_path: Path, fake_qemu: Path,
                                                  private_roots: tuple[Path, Path]) -> None:  # fmt: skip
    kernel = tmp_path / "bzImage"
    kernel.write_bytes(b"")
    q = QemuProcess(QemuConfig(kernel=kernel, accel="tcg", tcg_thread="single"), qemu_binary=str(fake_qemu))
    try:
        assert q.argv[q.argv.index("-accel") + 1] == "tcg,thread=single"
    finally:
        q.terminate(timeout=1.0)
    q = QemuProcess(QemuConfig(kernel=kernel, accel="tcg"), qemu_binary=str(fake_qemu))
    try:
        assert q.argv[q.argv.index("-accel") + 1] == "tcg"
    finally:
        q.terminate(timeout=1.0)


# -- bad settings leave nothing behind ---------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"disk_interface": "scsi"}, "unknown disk interface"),
        ({"memory": 64 << 20}, "too small"),
        ({"smp": 0}, "at least one vCPU"),
        ({"tcg_thread": "one"}, "unknown TCG thread mode"),
    ],
)
def test_bad_settings_leave_no_directory(tmp_path: Path, fake_qemu: Path, private_roots: tuple[Path, Path],
                                         change: dict[str, object], message: str) -> None:  # fmt: skip
    kernel = tmp_path / "bzImage"
    kernel.write_bytes(b"")
    config = QemuConfig(kernel=kernel, disk=kernel)
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(TargetError, match=message):
        QemuProcess(config, qemu_binary=str(fake_qemu))
    assert not any(private_roots[0].iterdir()) and not any(private_roots[1].iterdir())


# -- the sweep ---------------------------------------------------------------------------------


def _aged(path: Path, seconds: float = 3600) -> Path:
    t = time.time() - seconds
    os.utime(path, (t, t))
    return path


def test_sweep_removes_only_what_no_qemu_and_no_owner_uses(private_roots: tuple[Path, Path]) -> None:
    run, shm = private_roots
    stale_run = run / "qprobe-run-stale"
    stale_shm = shm / "qprobe-stale"
    for d in (stale_run, stale_shm):
        d.mkdir()
        (d / "ram").write_bytes(b"x")
        _aged(d)
    young = run / "qprobe-run-young"  # a QEMU still starting
    young.mkdir()
    used = _aged_dir(shm / "qprobe-used")
    locked = _aged_dir(run / "qprobe-run-locked")
    other = _aged_dir(run / "not-ours")
    # A live QEMU names its RAM file on its command line.
    user = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)", f"{used}/ram"])
    # Popen may return (vfork) before the kernel has set up the new program's command line.
    assert wait_until(lambda: b"qprobe-used" in Path(f"/proc/{user.pid}/cmdline").read_bytes())
    fd = os.open(locked, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a live owner
    try:
        removed = sweep_stale()
    finally:
        user.kill()
        user.wait()
        os.close(fd)
    assert sorted(removed) == sorted([stale_run, stale_shm])
    assert not stale_run.exists() and not stale_shm.exists()
    assert young.exists() and used.exists() and locked.exists() and other.exists()


def _aged_dir(path: Path) -> Path:
    path.mkdir()
    return _aged(path)


def test_sweep_ignores_symlinks(private_roots: tuple[Path, Path], tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "file").write_text("keep me")
    link = private_roots[0] / "qprobe-run-link"
    link.symlink_to(precious)
    os.utime(link, (0, 0), follow_symlinks=False)
    assert sweep_stale() == []
    assert (precious / "file").read_text() == "keep me"


def test_starting_a_vm_sweeps(tmp_path: Path, fake_qemu: Path, private_roots: tuple[Path, Path]) -> None:
    stale = _aged_dir(private_roots[1] / "qprobe-left-by-a-host-crash")
    kernel = tmp_path / "bzImage"
    kernel.write_bytes(b"")
    q = QemuProcess(QemuConfig(kernel=kernel), qemu_binary=str(fake_qemu))
    try:
        assert not stale.exists()
        assert q.shmdir.exists()
        assert sweep_stale(grace=0) == []  # our own live directories are in use
    finally:
        q.terminate()


def test_an_aarch64_guest_boots_on_the_virt_board(tmp_path: Path, fake_qemu: Path,
                                                 private_roots: tuple[Path, Path]) -> None:  # fmt: skip
    kernel = tmp_path / "Image"
    kernel.write_bytes(b"")
    q = QemuProcess(QemuConfig(kernel=kernel, accel="tcg", arch="aarch64", memory=512 << 20),
                    qemu_binary=str(fake_qemu))  # fmt: skip
    try:
        argv = q.argv
        assert argv[argv.index("-machine") + 1].startswith("virt,")
        assert argv[argv.index("-cpu") + 1] == "max,pauth-impdef=on"
        append = argv[argv.index("-append") + 1].split()
        # The PL011 is the kernel's console, the PCI 16550 the guest's shell; the RAM above mem= is the scratch area.
        assert "console=ttyAMA0,115200" in append and "qprobe.shell=ttyS0" in append
        assert "pci-serial,chardev=sh0" in argv and argv.count("-serial") == 1
        assert q.scratch_phys == 0x4000_0000 + (480 << 20) and "mem=480M" in append
        assert "isa-debugcon" not in " ".join(argv) and q.shell_path is not None and q.doorbell_path is None
    finally:
        q.terminate(timeout=1.0)
