"""Boot-time probes through the shell (``qprobe shell --boot``) and the pytest plugin
(``--qprobe-boot-event``, ``probes=`` in ``qprobe_boot_kwargs``), against the kernel's own account
of its boot.

Booted with ``initcall_debug``, the kernel logs every initcall ``do_one_initcall`` runs; an event on
``do_one_initcall`` armed before the kernel's first instruction counts exactly those calls, and lists
them in the kernel's order.  ``start_kernel`` runs once; ``start_secondary`` once on every vCPU but
the boot CPU, as many as the guest's own /proc/cpuinfo lists.
"""

from __future__ import annotations

import collections
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qprobe.images import get_image

from .conftest import IMAGE
from .test_boot_probes import CALLING, RETURNED, TCG, _kernel_initcalls

pytestmark = pytest.mark.vm
ROOT = Path(__file__).resolve().parents[2]
SMP = 2
CMDLINE = "initcall_debug log_buf_len=8M"
MARK = "@@qp-test-"


def _sections(stdout: str) -> dict[str, str]:
    """The shell's output cut at the ``run echo @@qp-test-NAME`` lines of its script, by NAME."""
    parts = re.split(rf"^{MARK}(\w+)\nexit status 0\n", stdout, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_shell_boot_events_count_what_the_kernel_did() -> None:
    script = "".join(f"run echo {MARK}{name}\n{command}\n" for name, command in [
        ("dmesg", "run dmesg"),
        ("cpus", "run grep -c ^processor /proc/cpuinfo"),
        ("stats", "stats"),
        ("events", "events"),
        ("list", "list"),
        ("total", "count ic since boot"),
        ("byfn", "count ic by fn since boot"),
        ("bycpu", "count ss by $cpu since boot"),
        ("show", "show sk since boot"),
        ("remove", "-:sk"),
        ("after", "events"),
    ])  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "qprobe.cli", "shell", "--image", IMAGE, "--smp", str(SMP), "--tcg-thread", TCG,
         "--boot", "--cmdline", CMDLINE,
         "p:ic do_one_initcall fn=%di:symbol", "p:sk start_kernel", "p:ss start_secondary"],
        input=script + "quit\n", capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = _sections(out.stdout)
    assert list(got) == ["dmesg", "cpus", "stats", "events", "list", "total", "byfn", "bycpu", "show", "remove",
                         "after"], out.stdout[-3000:]  # fmt: skip
    kernel = _kernel_initcalls(got["dmesg"])
    assert len(kernel) > 100, got["dmesg"][-3000:]
    cpus = int(got["cpus"].split()[0])
    assert cpus == SMP

    stats = {row.split()[0]: row.split()[1:4] for row in got["stats"].splitlines()[1:]}
    assert stats["kprobes/ic"] == [str(len(kernel)), "0", "0"], got["stats"]
    assert stats["kprobes/sk"] == ["1", "0", "0"], got["stats"]
    assert stats["kprobes/ss"] == [str(cpus - 1), "0", "0"], got["stats"]

    assert got["events"].splitlines() == ["p:kprobes/ic do_one_initcall fn=%di:symbol", "p:kprobes/sk start_kernel",
                                          "p:kprobes/ss start_secondary"]  # fmt: skip
    listing = {line.split()[2].split("+")[0]: line for line in got["list"].splitlines()}
    assert listing["start_kernel"].endswith("[ANYWHERE][GONE]"), got["list"]  # __init text, freed
    # do_one_initcall is __init_or_module (init/main.c): __init in a kernel without modules, retired with it.
    modules = get_image(IMAGE, fetch=False).config_option("MODULES") is not None
    if modules:  # kept text: on the int3 path once booted
        assert "[ANYWHERE]" not in listing["do_one_initcall"], got["list"]
    else:
        assert listing["do_one_initcall"].endswith("[ANYWHERE][GONE]"), got["list"]
    # The shell's maps over the hits made before its prompt came up ("since boot").
    assert got["total"] == f"@: {len(kernel)}\n"
    by_fn = dict(re.findall(r"^@\[(.*)\]: (\d+)$", got["byfn"], re.M))
    assert {fn: int(n) for fn, n in by_fn.items()} == collections.Counter(fn for fn, _ret in kernel)
    assert got["bycpu"].splitlines() == [f"@[{cpu}]: 1" for cpu in range(1, cpus)]
    # init_task is "swapper" until sched_init names the boot CPU's idle task "swapper/0"
    # (past its ENDBR on a kernel built with IBT, as the kernel's own kprobe would be)
    assert re.fullmatch(r"\s*swapper\S*-0\s+\[000\] \S+\s+[\d.]+: sk: \(start_kernel\+0x[0-9a-f]+/0x[0-9a-f]+\)\n",
                        got["show"]), got["show"]  # fmt: skip
    assert got["remove"] == "removed kprobes/sk (1 hits)\n"
    assert got["after"].splitlines() == ["p:kprobes/ic do_one_initcall fn=%di:symbol", "p:kprobes/ss start_secondary"]
    assert not re.search(r"^error: ", out.stdout, re.M), out.stdout[-3000:]  # the shell's errors


# The kernel's initcall list, as tests/vm/test_boot_probes.py reads it from dmesg.
_ORACLE = (f"CALLING = re.compile({CALLING.pattern!r}, re.M)\nRETURNED = re.compile({RETURNED.pattern!r}, re.M)\n\n\n"
           + inspect.getsource(_kernel_initcalls))  # fmt: skip

INNER = (
    """
import re

import pytest

from qprobe import Kprobe

SK = Kprobe("start_kernel")
LS = Kprobe("ksys_lseek")  # kept text: on the int3 path once booted


@pytest.fixture(scope="module")
def qprobe_boot_kwargs():
    return {"cmdline": CMDLINE, "probes": [SK, LS, "p:ss start_secondary"], "tcg_thread": "single"}


"""
    + f"CMDLINE = {CMDLINE!r}\n"
    + _ORACLE
    + """

def test_boot_counts_are_the_kernel_s(qprobe_target, qprobe_boot_events):
    dmesg = qprobe_target.run("dmesg").check().output
    cpus = int(qprobe_target.run("grep -c ^processor /proc/cpuinfo").check().output)
    kernel = _kernel_initcalls(dmesg)
    assert len(kernel) > 100
    ic = qprobe_boot_events["ic"]  # --qprobe-boot-event
    assert ic is qprobe_boot_events["kprobes/ic"] is qprobe_target.events["kprobes/ic"]
    assert (ic.nhit, ic.nmissed, ic.evicted) == (len(kernel), 0, 0)
    assert [hit.args["fn"] for hit in ic.hits] == [fn for fn, _ret in kernel]
    assert qprobe_boot_events["ss"].nhit == cpus - 1  # probes= definition
    assert SK.nhit == 1 and SK.gone  # probes= Kprobe, retired with __init text


def test_a_test_s_own_probes(qprobe_target, qprobe_reset):
    qprobe_reset.watch("ksys_lseek")  # its text checked after the test: the boot probe's int3 or jump is the VM's
    qprobe_target.register_kprobe(Kprobe("ksys_lseek"))
    qprobe_target.register_kprobe(Kprobe("__x64_sys_getppid", anywhere=True))


def test_boot_probes_outlive_each_test_s_reset(qprobe_target, qprobe_boot_events, qprobe_reset):
    qprobe_reset.strict = True  # the boot-time probes left registered are the VM's, not this test's
    listing = qprobe_target.list_probes()
    assert listing.count(" ksys_lseek+") == 1 and "getppid" not in listing  # the last test's probes were removed
    assert "do_one_initcall" in listing and "start_secondary" in listing and "start_kernel" in listing
    assert qprobe_boot_events["ic"].registered and SK.registered and LS.registered and not LS.anywhere
"""
)


def test_plugin_boot_events_count_what_the_kernel_did(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(INNER)
    argv = [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "test_inner.py", "--qprobe-image", IMAGE,
            "--qprobe-smp", str(SMP), "--qprobe-boot-event", "p:ic do_one_initcall fn=%di:symbol"]  # fmt: skip
    out = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-5000:]
    assert "3 passed" in out.stdout, text[-5000:]
