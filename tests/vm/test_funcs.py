"""Finding functions before probing them: `qprobe funcs`, the host's symbol check, wildcard events.

The guest kernel is the oracle: whether a function can take a kprobe event is
asked of its own kprobe_events in the same VM.
"""

from __future__ import annotations

import collections
import fnmatch
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

import qprobe
from qprobe import cli
from qprobe.images import get_image
from qprobe.shell import Shell

from .conftest import IMAGE, has_fentry_call, text_symbols, vmlinux_of
from .guest_oracle import TRACING, _put_file, guest_verdicts

pytestmark = pytest.mark.vm
ROOT = Path(__file__).resolve().parents[2]


def _qprobe(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qprobe.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)  # fmt: skip


# Functions built without an __fentry__ call (notrace), two or more to a glob: 6.1's ACL helpers are
# gone from 6.12; lib/seq_buf.c is notrace in both.
NOTRACE_GLOBS = ("vfs_set_acl_prepare_k*", "seq_buf_put*")
NOTRACE = "notrace: no __fentry__ site, the kernel refuses kprobe events there"


def _notrace(image: str) -> tuple[str, list[str]]:
    """The first of NOTRACE_GLOBS whose functions the image's vmlinux has, none calling __fentry__, and them.

    Only a kernel with dynamic ftrace has notrace functions: without it no function has an __fentry__
    site to tell them by, and the kernel's own check (within_notrace_func) is not built.
    """
    img = get_image(image, fetch=False)
    if img.config_option("DYNAMIC_FTRACE") != "y":
        pytest.skip(f"image {image}: no CONFIG_DYNAMIC_FTRACE, so no function is notrace")
    vmlinux = img.vmlinux
    for glob in NOTRACE_GLOBS:
        found = sorted(fnmatch.filter(text_symbols(vmlinux), glob))
        if len(found) >= 2 and not any(has_fentry_call(vmlinux, n) for n in found):
            return glob, found
    pytest.skip(f"image {image}: no function of {' '.join(NOTRACE_GLOBS)} is built without __fentry__")


@pytest.mark.parametrize(
    ("definition", "words"),
    [
        ("p:x ksys_raed", ["no symbol 'ksys_raed'", "did you mean ksys_read"]),
        ("p:x finish_task_switch", ["did you mean finish_task_switch.isra.0"]),
        ("r:x NOTRACE", ["cannot probe NOTRACE: notrace"]),
        ("p:x nosuchprefix_*", ["no function matches 'nosuchprefix_*'"]),
    ],
)
def test_a_bad_symbol_is_refused_on_the_host_before_any_boot(
    definition: str, words: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a VM was booted for a symbol vmlinux does not have")

    monkeypatch.setattr(qprobe, "boot", refuse)
    if "NOTRACE" in definition:  # a function of the image's built without __fentry__
        func = _notrace(IMAGE)[1][0]
        definition, words = definition.replace("NOTRACE", func), [w.replace("NOTRACE", func) for w in words]
    for command in ("trace", "list"):
        assert cli.main([command, "--image", IMAGE, definition]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and err.startswith(f"qprobe: error: {definition}: "), err
        assert all(w in err for w in words), err


@pytest.mark.qprobe_needs_config("KPROBE_EVENTS")  # the guest's own verdicts
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
    glob, notrace = _notrace(target.image.name if target.image is not None else IMAGE)
    sh.execute(f"funcs vfs_rea? {glob}")
    width = max(len(n) for n in ["vfs_read", *notrace])
    # A notrace function is refused for the kernel's int3 only: a stub breakpoint (--anywhere) takes it.
    refused = f"cannot probe: {NOTRACE} (--anywhere: a stub breakpoint)"
    rows = {"vfs_read": "vfs_read", **{n: f"{n:<{width}}  {refused}" for n in notrace}}
    assert out.getvalue().splitlines() == [rows[n] for n in sorted(rows)] + [
        f"{len(rows)} functions match 'vfs_rea?' '{glob}': 1 can be probed, {len(notrace)} cannot"
    ]
    out.seek(0)
    out.truncate()
    sh.execute("p:x ksys_raed fd=%di")
    assert "Invalid probed address or symbol: no symbol 'ksys_raed' (did you mean ksys_read" in out.getvalue()
    assert not target.events


def _notrace_function(vmlinux: Path, name: str) -> bool:
    """Whether the kernel refuses a kprobe event on ``name`` as notrace: it has no __fentry__ call, nor has
    the function a suffixed copy (``.cold``, ``.isra.0``) was split from (within_notrace_func())."""
    if has_fentry_call(vmlinux, name):
        return False
    base = name.split(".")[0]
    return base == name or base not in text_symbols(vmlinux) or not has_fentry_call(vmlinux, base)


TRACE_LINE = re.compile(r"^\s*(?P<comm>.+)-(?P<pid>\d+)\s+\[(?P<cpu>\d+)\]\s+\S+\s+[\d.]+: (?P<event>\w+): ")
WORK = "workload read 5 100; workload lseek 7; workload getppid 3"


def _guest_counts(target: qprobe.Target, defs: list[str], flt: str) -> collections.Counter[str]:
    """Hits per event of the guest kernel's own kprobe events ``defs`` (filtered by ``flt``) while WORK runs."""
    _put_file(target, "/tmp/wild-defs", ("\n".join(defs) + "\n").encode())
    try:
        target.run(f"while read -r d; do echo \"$d\" >> {TRACING}/kprobe_events; done < /tmp/wild-defs; "
                   f"for f in {TRACING}/events/gw/*/filter; do echo '{flt}' > $f; done; "
                   f"echo > {TRACING}/trace; echo 1 > {TRACING}/events/gw/enable").check()  # fmt: skip
        listed = target.run(f"grep -c '^p:gw/' {TRACING}/kprobe_events").check().output.split()[-1]
        assert int(listed) == len(defs), "the guest refused a function qprobe probed"
        target.run(WORK).check()
        target.run(f"echo 0 > {TRACING}/events/gw/enable").check()
        trace = target.run(f"cat {TRACING}/trace").check().output
    finally:
        target.run(f"echo 0 > {TRACING}/events/gw/enable; echo > {TRACING}/kprobe_events")
    written = re.search(r"entries-in-buffer/entries-written: (\d+)/(\d+)", trace)
    assert written and written[1] == written[2], "the guest's trace buffer overran"
    return collections.Counter(m["event"] for line in trace.splitlines() if (m := TRACE_LINE.match(line)))


@pytest.mark.qprobe_needs_config("KPROBE_EVENTS")  # the guest's own verdicts and counts
def test_a_wildcard_probes_every_match_and_counts_what_the_guest_kernel_counts(
    target: qprobe.Target, guard: dict[int, bytes]
) -> None:
    """`p:vfs vfs_*`: an event per probeable function, the refusals said; hits for the workload's process equal
    the guest's own kprobe events on the same functions, run after ours on the same workload in the same VM."""
    flt = 'comm == "workload"'
    target.run(WORK).check()  # once before either count, so that both find the same caches warm
    found = target.add_events("p:vfs vfs_* fd=%di", filter=flt)
    try:
        target.run(WORK).check()
    finally:
        for te in found.events:
            target.remove_event(te)
    probed = {te.definition.symbol: te for te in found.events}
    assert all(te.name == f"vfs/{te.definition.symbol.replace('.', '_')}" for te in found.events)  # type: ignore[union-attr]
    assert "vfs_read" in probed and "vfs_caches_init" in found.refused
    # Refused as notrace: exactly the matches built without an __fentry__ call (6.1 has two, 6.12 none).
    vmlinux = vmlinux_of(target)
    unique = [*probed, *(n for n, why in found.refused.items() if not why.startswith("not unique"))]
    notrace = {n for n in unique if n in text_symbols(vmlinux) and _notrace_function(vmlinux, n)}
    assert {n for n, why in found.refused.items() if why.startswith("notrace")} == notrace
    # The guest kernel refuses every function qprobe refused, and takes every one it probed (counted below).
    verdicts = guest_verdicts(target, [[f"p:qpw {name}"] for name in found.refused])
    assert not any(v[0].ok for v in verdicts), dict(zip(found.refused, verdicts, strict=True))
    guest = _guest_counts(target, [f"p:gw/{te.definition.event} {name}" for name, te in probed.items()], flt)
    ours = {te.definition.event: te.nhit for te in found.events}
    assert sum(ours.values()) >= 5 + 7 and sum(1 for n in ours.values() if n) >= 4, ours
    assert ours == {event: guest.get(event, 0) for event in ours}, (ours, guest)


def test_shell_wildcard_events_count_by_function(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    out = io.StringIO()
    sh = Shell(target, out=out)

    def do(line: str) -> list[str]:
        out.seek(0)
        out.truncate()
        sh.execute(line)
        return out.getvalue().splitlines()

    try:
        assert do("p:sk ksys_*seek* fd=%di") == ["added 1 events  (sk/*: one per function matching ksys_*seek*)"]
        assert [te.name for te in target.events.values()] == ["sk/ksys_lseek"]
        assert do("p:vfs vfs_read*")[0] == "added 3 events  (vfs/*: one per function matching vfs_read*)"
        counts = do("count vfs sk run workload lseek 4")
        assert "@[ksys_lseek]: 4" in counts, counts
        removed = [line.split(" (")[0] for line in do("-:vfs/")]  # a group's every event, as kprobe_events takes it
        assert removed == ["removed vfs/vfs_read", "removed vfs/vfs_readlink", "removed vfs/vfs_readv"]
        assert do("events") == ["p:sk/ksys_lseek ksys_lseek fd=%di"]
    finally:
        for te in list(target.events.values()):
            target.remove_event(te)
