"""A qprobe killed with SIGKILL while probes are armed; the next attach restores the text.

Also covers the CLI's ``boot`` (keeps the VM, prints how to attach) and
``attach``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import qprobe
from qprobe.paths import cache_dir

from .conftest import sigkill_when, workload_result

pytestmark = pytest.mark.vm

PROBER = textwrap.dedent(
    """
    import sys, time, qprobe
    t = qprobe.attach(sys.argv[1])
    kps = [qprobe.Kprobe(symbol_name=n) for n in ("ksys_lseek", "__x64_sys_getppid")]
    t.register_kprobes(kps)
    deadline = time.monotonic() + 30
    while "[OPTIMIZED]" not in t.list_probes() and time.monotonic() < deadline:
        time.sleep(0.1)  # ksys_lseek's jump in place: its bytes are also in the guest's kprobe_blacklist
    print("ARMED", flush=True)
    while True:
        time.sleep(1)
    """
)


def _fence_links(t: qprobe.Target) -> int:
    """The words that link qprobe's entries into the guest's kprobe_blacklist (a kernel with kprobes)."""
    return 2 if "kprobe_blacklist" in t.symbols else 0


def test_sigkill_with_probes_armed_then_attach_restores_text(booted: str) -> None:
    with qprobe.attach(booted) as t:
        names = ("ksys_lseek", "__x64_sys_getppid")
        original = {n: t.read(n, t.symbols.lookup(n).size) for n in names}
        left = 3 + _fence_links(t)
    sigkill_when(PROBER, [booted], "ARMED")
    cli = subprocess.run([sys.executable, "-m", "qprobe.cli", "attach", booted], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    # The two probes (a jump or an int3 each), the scratch-area mapping and the blacklist links were left behind.
    assert f"restored {left} leftover patch(es)" in cli.stdout
    with qprobe.attach(booted) as t:
        assert t.recovered == 0
        for n in names:
            assert t.read(n, len(original[n])) == original[n], f"{n} was not restored"
        # The formerly probed functions run normally.
        assert int(workload_result(t.run("workload lseek 20").check().output)["errors"]) == 0
        assert workload_result(t.run("workload getppid 20").check().output)["n"] == "20"
        assert t.oopses() == [], t.console.tail(60)  # type: ignore[union-attr]


def _spellings(address: str, tmp: Path) -> list[str]:
    """Ways of naming one VM's gdbstub: with and without ``unix:``, through ``.``, through a symlink."""
    sock = Path(address.removeprefix("unix:"))
    link = tmp / "run"
    link.symlink_to(sock.parent)
    return [address, str(sock), f"unix:{sock.parent}/./{sock.name}", str(link / sock.name)]


def test_a_crash_is_recovered_through_every_spelling_of_the_address(booted: str, tmp_path: Path) -> None:
    # The journal is named after the VM itself: armed through one spelling, found through the next.
    spellings = _spellings(booted, tmp_path)
    with qprobe.attach(booted) as t:
        original = {n: t.read(n, t.symbols.lookup(n).size) for n in ("ksys_lseek", "__x64_sys_getppid")}
        left = 3 + _fence_links(t)
    for armed, recovered in zip(spellings, spellings[1:] + spellings[:1], strict=True):
        sigkill_when(PROBER, [armed], "ARMED")
        cli = subprocess.run([sys.executable, "-m", "qprobe.cli", "attach", recovered], capture_output=True, text=True)
        assert cli.returncode == 0, cli.stderr
        assert f"restored {left} leftover patch(es)" in cli.stdout, (armed, recovered, cli.stdout)
    with qprobe.attach(booted) as t:
        assert t.recovered == 0
        assert {n: t.read(n, len(b)) for n, b in original.items()} == original
        assert workload_result(t.run("workload getppid 5").check().output)["n"] == "5"
        assert t.oopses() == [], t.console.tail(60)  # type: ignore[union-attr]


def test_a_journal_that_does_not_match_the_guest_is_refused(booted: str) -> None:
    sigkill_when(PROBER, [booted], "ARMED")
    journal = next(iter(sorted(cache_dir("journal").glob("*.json"), key=lambda p: p.stat().st_mtime)[-1:]))
    data = json.loads(journal.read_text())
    good = json.dumps(data)
    # A probe's patch: its int3, or its jump if the optimizer was quicker than the SIGKILL.
    probe = next(p for p in data["patches"] if p["what"] in ("int3", "optjmp"))
    probe["old"] = probe["new"] = "90"  # the guest holds neither
    journal.write_text(json.dumps(data))
    cli = subprocess.run([sys.executable, "-m", "qprobe.cli", "attach", booted], capture_output=True, text=True)
    assert cli.returncode == 2 and cli.stderr.count("\n") == 1, cli.stderr
    assert (
        f"the undo journal {journal} does not match this guest" in cli.stderr and "nothing was restored" in cli.stderr
    )
    journal.write_text("{broken")
    cli = subprocess.run([sys.executable, "-m", "qprobe.cli", "attach", booted], capture_output=True, text=True)
    assert cli.returncode == 2 and f"the undo journal {journal} cannot be read" in cli.stderr, cli.stderr
    journal.write_text(good)
    links = sum(p["what"] == "kprobe_blacklist link" for p in data["patches"])
    assert links in (0, 2)  # none on a kernel without kprobes
    cli = subprocess.run([sys.executable, "-m", "qprobe.cli", "attach", booted], capture_output=True, text=True)
    assert f"restored {3 + links} leftover patch(es)" in cli.stdout, cli.stderr


def test_a_second_attach_is_told_at_once_that_one_is_attached(booted: str) -> None:
    with qprobe.attach(booted):
        t0 = time.monotonic()
        cli = subprocess.run([sys.executable, "-m", "qprobe.cli", "attach", booted], capture_output=True, text=True)
        assert time.monotonic() - t0 < 10  # Python and qprobe start-up: no wait for an answer that cannot come
        assert cli.returncode == 2 and cli.stderr.count("\n") == 1, cli.stderr
        assert "another qprobe is attached to" in cli.stderr, cli.stderr
    cli = subprocess.run([sys.executable, "-m", "qprobe.cli", "attach", booted], capture_output=True, text=True)
    assert cli.returncode == 0 and "restored 0 leftover patch(es)" in cli.stdout, cli.stderr


STUCK = textwrap.dedent(
    """
    import sys, threading, time, qprobe
    t = qprobe.attach(sys.argv[1])
    def handler(kp, regs):
        print("IN_HANDLER", flush=True)
        time.sleep(3600)  # the vCPU now spins in the optimized stub, waiting for us
    kp = qprobe.Kprobe(symbol_name="ksys_lseek", pre_handler=handler)  # its entry can take a jump
    t.register_kprobe(kp)
    assert "[OPTIMIZED]" in t.list_probes()
    threading.Thread(target=t.run, args=("workload lseek 3",), daemon=True).start()
    time.sleep(3600)
    """
)


def test_sigkill_while_a_vcpu_waits_in_the_optimized_stub(booted: str) -> None:
    sigkill_when(STUCK, [booted], "IN_HANDLER")
    with qprobe.attach(booted) as t:
        assert t.recovered >= 2  # the jump and the scratch mapping
        # The stuck vCPU was answered and stepped out; the guest carries on.
        assert workload_result(t.run("workload getppid 5").check().output)["n"] == "5"
        assert t.oopses() == [], t.console.tail(60)  # type: ignore[union-attr]


RETURNING = textwrap.dedent(
    """
    import sys, time, qprobe
    t = qprobe.attach(sys.argv[1])
    def handler(ri, regs):
        print("IN_HANDLER", flush=True)
        time.sleep(3600)  # the sleeper's vCPU now spins in the stub, waiting for us
    rp = qprobe.Kretprobe(symbol_name="hrtimer_nanosleep", handler=handler if sys.argv[2] == "ro" else None)
    t.register_kretprobe(rp)
    assert "[OPTIMIZED]" in t.list_probes()
    t.run(f"(sleep {sys.argv[3]}; echo slept > /tmp/slept) >/dev/null 2>&1 &")
    while not t.kretprobes.live_instances(rp):
        time.sleep(0.05)
    print("IN_FLIGHT", flush=True)
    time.sleep(3600)
    """
)


@pytest.mark.parametrize(("kind", "wait_for", "sleep"), [("rf", "IN_FLIGHT", 8), ("ro", "IN_HANDLER", 1)])
def test_sigkill_with_a_return_in_flight_through_a_guest_instance(booted: str, kind: str, wait_for: str,
                                                                  sleep: int) -> None:  # fmt: skip
    """The guest itself replaced the sleeper's return address (or its return waits in the stub): recovery
    puts the real one back from the instance array in guest RAM, and the sleeper returns normally."""
    sigkill_when(RETURNING, [booted, kind, str(sleep)], wait_for)
    with qprobe.attach(booted) as t:
        # The jump, its blacklist links and the scratch mapping; for rf also the sleeping task's stack slot.
        assert t.recovered == (3 if kind == "rf" else 2) + _fence_links(t)
        t.run("while [ ! -e /tmp/slept ]; do sleep 0.2; done; rm /tmp/slept", timeout=120).check()
        assert workload_result(t.run("workload getppid 5").check().output)["n"] == "5"
        assert t.oopses() == [], t.console.tail(60)  # type: ignore[union-attr]
