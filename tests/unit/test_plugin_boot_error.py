"""A guest that will not boot fails each test that asks for ``qprobe_target`` at setup with qprobe's one
line: no traceback, and not the boot error's chained beneath it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

MESSAGE = (
    "the guest of image 'debian-cloud' printed a login prompt on its console ('buildroot login:') and never "
    "started qprobe's shell: the image's own init ran a getty"
)

CONFTEST = f"""
import qprobe
from qprobe.errors import GuestBootFailed


def _boot(image, **kwargs):
    exc = GuestBootFailed({MESSAGE!r})
    exc.add_note("guest console kept in /tmp/console.log")
    raise exc


qprobe.boot = _boot
"""

INNER = """
def test_uses_the_vm(qprobe_target):
    pass
"""


def test_a_boot_error_is_one_line_at_setup(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_inner.py").write_text(INNER)
    run = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "test_inner.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    out = run.stdout
    assert run.returncode == 1 and "1 error" in out, out
    assert f"qprobe could not boot debian-cloud: {MESSAGE} (guest console kept in /tmp/console.log)" in out, out
    assert "GuestBootFailed" not in out and "During handling" not in out and "Traceback" not in out, out
