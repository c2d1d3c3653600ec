"""Issue 7: a failing user test shows the guest console tail and the probes left registered in its report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import IMAGE

pytestmark = pytest.mark.vm

FAILING = """
from qprobe import Kprobe


def test_wrong_count(qprobe_target):
    kp = Kprobe(symbol_name="__x64_sys_getppid")
    qprobe_target.register_kprobe(kp)
    qprobe_target.run("workload getppid 3").check()
    assert kp.nhit == 4
"""


def test_a_failing_test_reports_the_guest_console(tmp_path: Path) -> None:
    (tmp_path / "test_fails.py").write_text(FAILING)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_fails.py", "--qprobe-image", IMAGE]
    out = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "assert 3 == 4" in out.stdout
    assert f"qprobe: guest console, last 40 lines ({IMAGE})" in out.stdout
    assert "workload mode=getppid n=3" in out.stdout  # what the guest printed, in the failure's report
    assert "__x64_sys_getppid+0x0" in out.stdout  # the probe the test left registered
