"""Issue 2: the target layer on the real default image (KASLR on)."""

from __future__ import annotations

import os
import random
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import qprobe
import qprobe.kernel.symbols
from qprobe.errors import QprobeError, TargetError, TargetGone, VmlinuxMismatch
from qprobe.images import get_image
from qprobe.vmm.qemu import QemuConfig, QemuProcess

from .conftest import IMAGE, bare_qemu, text_symbols, vmlinux_of


def test_run_returns_output_and_status(target: qprobe.Target) -> None:
    r = target.run("echo hello; echo err >&2; exit 3")
    assert r.output.splitlines() == ["hello", "err"]
    assert r.status == 3
    assert target.run("true").status == 0


def _socket_inodes(pid: int) -> set[int]:
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(int(link[len("socket:[") : -1]))
    return out


def _network_socket_inodes() -> set[int]:
    """Every TCP and UDP socket of this network namespace (/proc/net/{tcp,udp}{,6})."""
    out = set()
    for name in ("tcp", "tcp6", "udp", "udp6"):
        path = Path("/proc/net") / name
        if path.exists():
            out |= {int(line.split()[9]) for line in path.read_text().splitlines()[1:]}
    return out


def test_nothing_listens_on_the_network_and_the_run_files_are_private(target: qprobe.Target) -> None:
    q = target.qemu
    assert q is not None
    for directory in (q.rundir, q.shmdir):
        st = directory.lstat()
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    for sock in (q.gdb_path, q.qmp_path, q.console_path, q.shell_path, q.doorbell_path):
        assert stat.S_ISSOCK(sock.lstat().st_mode) and sock.parent == q.rundir
    assert q.ram_path.parent == q.shmdir
    assert stat.S_IMODE((q.rundir / "session.json").stat().st_mode) == 0o600
    # QEMU's sockets are all Unix sockets: none is a TCP or UDP socket, listening or not.
    assert _socket_inodes(q.proc.pid) and not _socket_inodes(q.proc.pid) & _network_socket_inodes()
    assert not _socket_inodes(os.getpid()) & _network_socket_inodes()


def test_boot_is_fast_and_kaslr_is_on(target: qprobe.Target) -> None:
    assert target.slide != 0, "KASLR should have moved the kernel"
    assert target.timings["boot"] < 60
    # The monitor answers through QEMU's own QMP client library.
    assert target.qemu is not None
    assert target.qemu.qmp("query-status")["status"] in ("running", "debug")  # type: ignore[index]


KALLSYMS_LINE = re.compile(r"([0-9a-f]{16}) (\w) (\S+)")


def test_symbols_match_proc_kallsyms(target: qprobe.Target) -> None:
    # The slab allocator's entry: Linux 6.10's allocation tagging ("mm/slab: enable slab allocation
    # tagging for kmalloc and friends") renamed kmem_cache_alloc to kmem_cache_alloc_noprof.
    slab = next(n for n in ("kmem_cache_alloc", "kmem_cache_alloc_noprof") if n in text_symbols(vmlinux_of(target)))
    names = ["vfs_read", "ksys_lseek", "__x64_sys_getppid", "do_sys_openat2", "schedule", "linux_banner",
             "jiffies", "asm_exc_int3", "_stext", "init_task", "memcpy", slab]  # fmt: skip
    pattern = "|".join(names)
    out = target.run(f"grep -E ' ({pattern})$' /proc/kallsyms").check().output
    seen = {}
    for line in out.splitlines():
        m = KALLSYMS_LINE.fullmatch(line)
        assert m is not None, line
        seen.setdefault(m[3], int(m[1], 16))
    assert set(seen) == set(names)
    for name, addr in seen.items():
        assert target.symbols.address(name) == addr, name
        # Aliases (startup_64 and _stext) share an address: any name there will do.
        alias, _, off = target.symbols.symbolize(addr).partition("+")
        assert off == "0x0" and target.symbols.address(alias) == addr


def test_shared_ram_reads_agree_with_the_gdbstub(target: qprobe.Target) -> None:
    rng = random.Random(1)
    s = target.symbols
    lo, hi = s.address("_stext"), s.address("_end")
    addrs = [rng.randrange(lo, hi - 64) for _ in range(1000)]
    gdb = target.gdb

    def compare() -> int:
        # Both reads happen while the VM is stopped, so data cannot change in between.
        tid = next(t for t in target.machine.vcpus if gdb.read_registers(t)["cs"] & 3 == 0)
        gdb.select(tid)
        gdb.set_physical(False)
        try:
            same = 0
            for a in addrs:
                n = rng.randrange(1, 64)
                if gdb.read_memory(a, n) == target.read(a, n):
                    same += 1
            return same
        finally:
            gdb.set_physical(True)

    assert target.machine.call(compare) == len(addrs)


def test_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(TargetError, match="does not exist") as e:
        QemuProcess(QemuConfig(kernel=tmp_path / "bzImage"))
    assert "\n" not in str(e.value)
    with pytest.raises(QprobeError, match="unknown image") as e:
        qprobe.boot("no-such-image")
    t0 = time.monotonic()
    with pytest.raises(TargetGone, match="cannot connect") as e:
        qprobe.attach("127.0.0.1:1", get_image(IMAGE, fetch=False).vmlinux)
    assert time.monotonic() - t0 < 10 and "\n" not in str(e.value)
    with pytest.raises(TargetError, match="non-local"):
        qprobe.attach("192.0.2.1:1234", "vmlinux")


def test_mismatched_vmlinux_is_refused() -> None:
    # Another build of a kernel: the other Debian 6.1 flavour (for those two, of the same source).
    other = get_image("debian-cloud" if IMAGE == "debian-rt" else "debian-rt").vmlinux
    with bare_qemu() as q:
        with pytest.raises(VmlinuxMismatch, match="not the running kernel") as e:
            qprobe.attach(f"unix:{q.gdb_path}", other, ram=q.ram_path, ram_size=q.config.memory)
        assert "\n" not in str(e.value)


def test_dead_qemu_fails_fast() -> None:
    img = get_image(IMAGE, fetch=False)
    with qprobe.boot(IMAGE) as t:
        assert t.qemu is not None
        os.killpg(t.qemu.proc.pid, signal.SIGKILL)
        kp = qprobe.Kprobe(symbol_name="ksys_lseek")
        t0 = time.monotonic()
        with pytest.raises(TargetGone) as e:
            t.register_kprobe(kp)
        assert time.monotonic() - t0 < 2
        assert "\n" not in str(e.value)
        with pytest.raises(TargetGone):
            t.run("true", timeout=5)
    assert img.vmlinux.exists()


def test_cli_boot_attach_and_version() -> None:
    out = subprocess.run([sys.executable, "-m", "qprobe.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("qprobe ")
    bad = subprocess.run([sys.executable, "-m", "qprobe.cli", "boot", "--file", "nocolon"],
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "bad --file" in bad.stderr


def test_guest_reboot_ends_the_session_with_a_message() -> None:
    with qprobe.boot(IMAGE) as t:
        kp = qprobe.Kprobe(symbol_name="ksys_lseek")
        t.register_kprobe(kp)
        t.guest_shell.write("reboot -f\n")  # type: ignore[union-attr]
        deadline = time.monotonic() + 60
        while t.machine.alive and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(TargetGone, match="rebooted") as e:
            t.run("true", timeout=5)
        assert "\n" not in str(e.value)


def test_stripped_vmlinux_with_system_map(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    img = get_image(IMAGE, fetch=False)
    assert img.system_map is not None
    stripped = tmp_path / "vmlinux.stripped"
    subprocess.run(["objcopy", "--strip-all", str(img.vmlinux), str(stripped)], check=True)
    with bare_qemu() as q:
        # The symbol cache is keyed by build-id, which stripping keeps: start from an empty one.
        monkeypatch.setenv("QPROBE_CACHE", str(tmp_path / "cache"))
        with pytest.raises(qprobe.SymbolError, match=r"System\.map"):
            qprobe.kernel.symbols.Symbols.load(stripped)
        with qprobe.attach(f"unix:{q.gdb_path}", stripped, ram=q.ram_path, ram_size=q.config.memory,
                           console=q.console_path, shell=q.shell_path, system_map=img.system_map) as t:  # fmt: skip
            out = t.run("grep -w ksys_lseek /proc/kallsyms").check().output
            assert t.symbols.address("ksys_lseek") == int(out.split()[0], 16)
            kp = qprobe.Kprobe(symbol_name="ksys_lseek")
            t.register_kprobe(kp)
            t.run("workload lseek 3").check()
            t.unregister_kprobe(kp)
            assert kp.nhit == 3


def test_extra_files_reach_the_guest(tmp_path: Path) -> None:
    script = tmp_path / "hello.sh"
    script.write_text("#!/bin/sh\necho hello-from-host $1\n")
    script.chmod(0o755)
    with qprobe.boot(IMAGE, files={"/bin/hello": script}) as t:
        assert t.run("hello 42").check().output.strip() == "hello-from-host 42"


def test_the_disk_image_boots_and_probes() -> None:
    with qprobe.boot("debian-cloud-disk") as t:
        assert t.run("cat /proc/mounts").check().output.startswith("/dev/root / ext2 ")
        assert "nvme0n1" in t.run("cat /proc/partitions").check().output
        kp = qprobe.Kprobe(symbol_name="__x64_sys_getppid")
        t.register_kprobe(kp)
        t.run("workload getppid 7").check()
        t.unregister_kprobe(kp)
        assert kp.nhit == 7 and t.oopses() == []


def test_a_reader_that_goes_away_is_not_an_error(tmp_path: Path) -> None:
    # `qprobe blacklist | head`, with a head that is done before qprobe prints (`true` reads nothing):
    # the pipe is broken at the first line; no traceback, and the VM goes as after any other end.
    err = tmp_path / "stderr"
    script = f'"{sys.executable}" -m qprobe.cli blacklist --image {IMAGE} 2>"$1" | true; exit ${{PIPESTATUS[0]}}'
    out = subprocess.run(["bash", "-c", script, "_", str(err)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 128 + signal.SIGPIPE, err.read_text()
    assert err.read_text() == ""
