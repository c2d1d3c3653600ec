"""A buildroot-style image, its root filesystem untouched, reached through qprobe's pre-init.

The images buildroot-ext2 and buildroot-cpio (kernels/images.toml) hold buildroot's skeleton and
BusyBox init (scripts/guest/buildroot): an inittab that runs rcS (syslogd, klogd, the network)
and a getty on the console, nothing of qprobe's.  qprobe boots them through its pre-init
(scripts/guest/preinit), which starts qprobe's shell and then execs the image's own init.  What is
checked comes from the guest: PID 1's command line and program, the processes its inittab
started, the mounts its fstab made; counts are what ``workload getppid N`` does (N getppid calls).
Every front end is driven against both forms: the API, ``qprobe trace --run``, ``qprobe shell``
and the pytest plugin.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import qprobe
from qprobe.images import get_image

pytestmark = pytest.mark.vm
ROOT = Path(__file__).resolve().parents[2]
IMAGES = ("buildroot-ext2", "buildroot-cpio")
# What the kernel runs as init: the disk's /sbin/init, or the initramfs's /init (buildroot's, which execs /sbin/init).
FIRST_INIT = {"buildroot-ext2": "/sbin/init", "buildroot-cpio": "/init"}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _once_up(t: qprobe.Target) -> str:
    """``ps`` once the image's init has started its getty: its sysinit actions (rcS, mounts) are done then.

    The shell comes up before the image's init has got that far: it is started first."""
    for _ in range(240):
        ps = t.run("ps -o pid,ppid,args").output
        if re.search(r"^\s*\d+\s+1\s+/sbin/getty ", ps, re.M):
            return ps
        time.sleep(0.5)
    pytest.fail(f"the image's init started no getty: {ps}")


@pytest.mark.parametrize("image", IMAGES)
def test_the_images_own_init_is_pid_1_and_its_inittab_ran_beside_qprobes_shell(image: str) -> None:
    img = get_image(image)
    root = img.disk or img.initrd
    assert root is not None
    before = _digest(root)
    with qprobe.boot(image) as t:
        ps = _once_up(t)
        # PID 1 is the image's BusyBox init (which names itself "init" in its argv), not qprobe's busybox.
        assert t.run("readlink /proc/1/exe").output.strip() == "/bin/busybox"
        assert t.run("tr '\\0' ' ' </proc/1/cmdline").output.split() == ["init"]
        if img.disk is not None:  # init/main.c's environment for init, as the kernel gives it (no PATH, PWD...)
            assert t.run("tr '\\0' ' ' </proc/1/environ").output.strip() == "HOME=/ TERM=linux"
        assert t.console is not None
        started = f"qprobe-preinit: qprobe's shell started on ttyS1; running the image's init {FIRST_INIT[image]}"
        assert started in t.console.text, t.console.tail()
        # The inittab's getty on the console, and the daemons rcS started, are running; the hostname is its.
        assert re.search(r"^\s*\d+\s+1\s+/sbin/getty -L\s+console 0 vt100\s*$", ps, re.M), ps
        assert re.search(r"^\s*\d+\s+1\s+/sbin/syslogd -n\s*$", ps, re.M), ps
        assert re.search(r"^\s*\d+\s+1\s+/sbin/klogd -n\s*$", ps, re.M), ps
        assert t.run("hostname").output.strip() == "buildroot"
        assert t.run("cat /etc/issue").output.strip() == "Welcome to Buildroot"
        # The image's mounts are its fstab's, none of the shell's; the shell sees them (its /tmp is the image's).
        mounts = [line.split()[1:3] for line in t.run("cat /proc/1/mounts").output.splitlines()]
        assert ["/tmp", "tmpfs"] in mounts and mounts.count(["/proc", "proc"]) == 1, mounts
        assert not [m for m in mounts if m[1] in ("tracefs", "debugfs") or m[0].startswith("/qprobe")], mounts
        assert t.run("echo seen >/tmp/qp-mark && cat /proc/1/root/tmp/qp-mark").output.strip() == "seen"
        assert t.run("ls /qprobe /proc/1/root/qprobe").status != 0  # nothing of the pre-init's is left in sight
        # Probes see the image's own programs.
        kp = qprobe.Kprobe(symbol_name="__x64_sys_getppid")
        t.register_kprobe(kp)
        out = t.run("workload getppid 3").check().output
        t.unregister_kprobe(kp)
        assert "mode=getppid n=3" in out and kp.nhit == 3, (out, kp.nhit)
    assert _digest(root) == before  # the root filesystem qprobe booted is unchanged


def _qprobe(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qprobe.cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)  # fmt: skip


@pytest.mark.parametrize("image", IMAGES)
def test_trace_run_counts_the_images_program(image: str) -> None:
    out = _qprobe("trace", "--image", image, "--run", "workload getppid 3", "p:gp __x64_sys_getppid")
    assert out.returncode == 0, out.stderr
    assert "mode=getppid n=3" in out.stderr, out.stderr
    assert out.stdout.splitlines()[-1].startswith("# gp: hits=3 nmissed=0 lost=0"), out.stdout


@pytest.mark.parametrize("image", IMAGES)
def test_qprobe_shell_counts_and_runs_the_images_commands(image: str) -> None:
    script = "p:gp __x64_sys_getppid\ncount gp by $comm run workload getppid 3\nrun cat /etc/hostname\nquit\n"
    out = _qprobe("shell", "--image", image, stdin=script)
    assert out.returncode == 0, out.stderr
    assert "@[workload]: 3" in out.stdout and "buildroot" in out.stdout.splitlines(), out.stdout


INNER = """
import time

import qprobe


def test_inner(qprobe_target):
    # Once the image's rcS is done (its getty runs): its shells call getppid too.
    while "/sbin/getty" not in qprobe_target.run("ps -o args").output:
        time.sleep(0.5)
    kp = qprobe.Kprobe(symbol_name="__x64_sys_getppid")
    qprobe_target.register_kprobe(kp)
    qprobe_target.run("workload getppid 3").check()
    qprobe_target.unregister_kprobe(kp)
    assert kp.nhit == 3
    assert qprobe_target.run("readlink /proc/1/exe").output.strip() == "/bin/busybox"  # the image's init, PID 1
"""


def test_the_plugin_runs_a_test_on_both_forms(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(INNER)
    images = [arg for image in IMAGES for arg in ("--qprobe-image", image)]
    argv = [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "test_inner.py", *images]
    out = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert len(re.findall(r"^PASSED test_inner\.py::test_inner", out.stdout, re.M)) == len(IMAGES), out.stdout
