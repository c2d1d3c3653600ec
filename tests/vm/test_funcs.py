"""Finding functions before probing them: `qprobe funcs`, the host's symbol check, wildcard events.

The guest kernel is the oracle: whether a function can take a kprobe event is
asked of its own kprobe_events in the same VM.
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

import qprobe
from qprobe import cli
from qprobe.shell import Shell

from .conftest import IMAGE
from .guest_oracle import guest_verdicts

pytestmark = pytest.mark.vm
ROOT = Path(__file__).resolve().parents[2]


def _qprobe(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qprobe.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)  # fmt: skip


@pytest.mark.parametrize(
    ("definition", "words"),
    [
        ("p:x ksys_raed", ["no symbol 'ksys_raed'", "did you mean ksys_read"]),
        ("p:x finish_task_switch", ["did you mean finish_task_switch.isra.0"]),
        ("r:x vfs_set_acl_prepare_kgid", ["cannot probe vfs_set_acl_prepare_kgid: notrace"]),
        ("p:x nosuchprefix_*", ["no function matches 'nosuchprefix_*'"]),
    ],
)
def test_a_bad_symbol_is_refused_on_the_host_before_any_boot(
    definition: str, words: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a VM was booted for a symbol vmlinux does not have")

    monkeypatch.setattr(qprobe, "boot", refuse)
    for command in ("trace", "list"):
        assert cli.main([command, "--image", IMAGE, definition]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and err.startswith(f"qprobe: error: {definition}: "), err
        assert all(w in err for w in words), err


def test_funcs_says_what_the_guest_kernel_accepts(target: qprobe.Target) -> None:
    """Each function `qprobe funcs` lists as probeable is one the guest's kprobe_events takes, and no other."""
    out = _qprobe("funcs", "--image", IMAGE, "vfs_*", "ksys_*", "*_notrace*", "finish_task_switch*")
    assert out.returncode == 0, out.stderr
    rows = [line.split("  cannot probe: ") for line in out.stdout.splitlines()]
    verdicts = {row[0].strip(): len(row) == 1 for row in rows}
    assert sum(verdicts.values()) >= 80 and not all(verdicts.values()), verdicts
    assert f"{len(rows)} functions match" in out.stderr
    names = sorted(verdicts)
    guest = guest_verdicts(target, [[f"p:qpf {name}"] for name in names])
    disagree = {n: (verdicts[n], str(v[0])) for n, v in zip(names, guest, strict=True) if v[0].ok != verdicts[n]}
    assert not disagree, disagree


def test_shell_funcs(target: qprobe.Target) -> None:
    out = io.StringIO()
    sh = Shell(target, out=out)
    sh.execute("funcs vfs_rea? vfs_set_acl_prepare_k*")
    assert out.getvalue().splitlines() == [
        "vfs_read",
        "vfs_set_acl_prepare_kgid  cannot probe: notrace: no __fentry__ site, the kernel refuses kprobe events there",
        "vfs_set_acl_prepare_kuid  cannot probe: notrace: no __fentry__ site, the kernel refuses kprobe events there",
        "3 functions match 'vfs_rea?' 'vfs_set_acl_prepare_k*': 1 can be probed, 2 cannot",
    ]
    out.seek(0)
    out.truncate()
    sh.execute("p:x ksys_raed fd=%di")
    assert "Invalid probed address or symbol: no symbol 'ksys_raed' (did you mean ksys_read" in out.getvalue()
    assert not target.events
