"""``--qprobe-no-skip``: a skipped test fails with its reason, for CI that must run every test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

INNER = """
import pytest


def test_skipped():
    pytest.skip("this image has no CONFIG_KPROBES")


@pytest.mark.xfail(reason="known")
def test_expected_to_fail():
    assert False


def test_passes():
    pass
"""


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_inner.py").write_text(INNER)
    return subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "test_inner.py", *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip


def test_a_skip_is_a_failure_only_when_asked(tmp_path: Path) -> None:
    plain = _pytest(tmp_path)
    assert plain.returncode == 0 and "1 passed, 1 skipped, 1 xfailed" in plain.stdout, plain.stdout
    strict = _pytest(tmp_path, "--qprobe-no-skip")
    assert strict.returncode == 1, strict.stdout
    assert "1 failed, 1 passed, 1 xfailed" in strict.stdout, strict.stdout
    assert "skipped, and --qprobe-no-skip makes a skip a failure: Skipped: this image has no CONFIG_KPROBES" in (
        strict.stdout
    )
