"""The plugin's checks after every VM test fire: changed kernel text, an oops line, a probe left behind
(strict), text that could not be snapshotted.  Every other VM test relies on them, so if they did
nothing all VM tests would pass; here a pytest run of its own makes each one fail a test."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import IMAGE

pytestmark = pytest.mark.vm

# Run in this order on one VM (one module); VICTIM is a system call nothing in the guest makes, so a
# byte changed in it is never executed.
INNER = """
from qprobe import Kprobe

VICTIM = "__x64_sys_kcmp"


def test_text_changed_behind_qprobes_back(qprobe_target):
    t = qprobe_target
    t.register_kprobe(Kprobe(symbol_name=VICTIM))  # the plugin snapshots VICTIM's text before its int3
    sym = t.symbols.lookup(VICTIM)
    addr = sym.addr + sym.size - 1  # past the bytes a jump-optimized probe copies and puts back
    byte = t.read(addr, 1)[0]
    t.machine.call(lambda: t.machine.write_phys(t.mem.virt_to_phys(addr), bytes([byte ^ 0xFF])))


def test_the_guest_prints_a_bug_line(qprobe_target):
    qprobe_target.run("echo 'BUG: planted by test_plugin_checks' > /dev/kmsg").check()


def test_the_guest_warns_while_a_command_runs(qprobe_target):
    # The kernel's log and the command's output go to two serial ports: the warning is still seen.
    out = qprobe_target.run(
        "(sleep 0.2; echo 'WARNING: CPU: 0 PID: 1 at planted/by/test_plugin_checks.c:1' > /dev/kmsg) & "
        "for i in 1 2 3 4 5 6 7 8; do echo step $i; sleep 0.1; done; wait"
    ).check()
    assert out.output == "".join(f"step {i}\\n" for i in range(1, 9))


def test_a_probe_left_registered_under_strict(qprobe_target, qprobe_reset):
    qprobe_reset.strict = True
    qprobe_target.register_kprobe(Kprobe(symbol_name="ksys_lseek"))


def test_a_snapshot_that_fails(qprobe_target, qprobe_reset, monkeypatch):
    def broken(start, size):
        raise RuntimeError("no text today")

    monkeypatch.setattr(qprobe_reset, "_pristine", broken)
    kp = Kprobe(symbol_name="ksys_read")
    qprobe_target.register_kprobe(kp)
    qprobe_target.unregister_kprobe(kp)


def test_a_clean_test_passes(qprobe_target, qprobe_reset):
    qprobe_reset.strict = True
    kp = Kprobe(symbol_name="__x64_sys_getppid")
    qprobe_target.register_kprobe(kp)
    qprobe_target.run("workload getppid 3").check()
    qprobe_target.unregister_kprobe(kp)
    assert kp.nhit == 3
"""


def _outcomes(stdout: str) -> dict[str, str]:
    """test name -> PASSED/FAILED/ERROR from ``-rA``'s short summary (a teardown error follows a pass)."""
    out: dict[str, str] = {}
    for outcome, name in re.findall(r"^(PASSED|FAILED|ERROR) test_inner\.py::(\w+)", stdout, re.M):
        out[name] = "ERROR" if out.get(name) == "ERROR" else outcome
    return out


def test_each_check_of_the_plugin_fails_a_test(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(INNER)
    argv = [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "test_inner.py", "--qprobe-image", IMAGE]
    out = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    outcomes = _outcomes(out.stdout)
    assert outcomes == {
        "test_text_changed_behind_qprobes_back": "ERROR",
        "test_the_guest_prints_a_bug_line": "FAILED",
        "test_the_guest_warns_while_a_command_runs": "FAILED",
        "test_a_probe_left_registered_under_strict": "ERROR",
        "test_a_snapshot_that_fails": "ERROR",
        "test_a_clean_test_passes": "PASSED",
    }, text
    assert re.search(r"kernel text of __x64_sys_kcmp changed at offset\(s\) 0x[0-9a-f]+: __x64_sys_kcmp\+", text), text
    assert "the guest kernel reported:" in text and "BUG: planted by test_plugin_checks" in text, text
    assert "WARNING: CPU: 0 PID: 1 at planted/by/test_plugin_checks.c:1" in text, text
    # The failure report: the kernel's log in the console's section, the commands' output in the shell's.
    consoles = re.findall(r"qprobe: guest console, last \d+ lines \(\S+\) -+\n(.*?)\n-", text, re.S)
    shells = re.findall(r"qprobe: guest shell, last \d+ lines \(\S+\) -+\n(.*?)\n-", text, re.S)
    assert any("WARNING: CPU: 0 PID: 1 at planted" in c for c in consoles), text
    assert any("step 8" in c for c in shells), text
    assert not any("step " in c for c in consoles) and not any("WARNING" in c for c in shells), text
    assert "the test left probes registered (removed now):" in text and "ksys_lseek+0x0" in text, text
    assert "could not snapshot the kernel text qprobe patched, so it was not checked: " in text, text
    assert "RuntimeError: no text today" in text, text


# Two modules, one VM each: once the first module's VM is closed nothing of the plugin's keeps its Target.
FIRST = """
import weakref

import holder


def test_first(qprobe_target):
    holder.targets.append(weakref.ref(qprobe_target))
"""
SECOND = """
import gc

import holder


def test_second(qprobe_target):
    gc.collect()
    first = holder.targets[0]()
    assert first is None, [type(r).__name__ for r in gc.get_referrers(first)]
"""


def test_a_module_s_target_is_freed_after_its_vm_is_closed(tmp_path: Path) -> None:
    """pytest keeps every test item to the end of the session: what the plugin keeps in them must not hold a
    Target (its symbols and drgn program are hundreds of MB), or memory grows with every module."""
    (tmp_path / "holder.py").write_text("targets = []\n")
    (tmp_path / "test_a_first.py").write_text(FIRST)
    (tmp_path / "test_b_second.py").write_text(SECOND)
    argv = [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "test_a_first.py", "test_b_second.py",
            "--qprobe-image", IMAGE]  # fmt: skip
    out = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "2 passed" in out.stdout, out.stdout + out.stderr
