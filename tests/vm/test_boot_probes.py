"""Boot-time probes (``qprobe trace --boot``) against the kernel's own account of its boot.

Booted with ``initcall_debug``, the kernel logs every initcall it runs through
``do_one_initcall`` (``calling  fn+0x0/0x.. @ pid`` before, ``initcall fn+0x0/0x..
returned R after N usecs`` after); probes on ``do_one_initcall``'s entry (its
function argument as a symbol) and return (``$retval``), armed before the kernel's
first instruction, must list the same initcalls in the same order with the same
return values.  ``start_kernel`` runs once, on the boot CPU; ``start_secondary``
once on every other vCPU.  The kernel's own boot-time event (``kprobe_event=`` on
the command line) on ``do_one_initcall`` starts counting once ``init_kprobe_trace``
(an fs_initcall) has created it: it counts the calls qprobe saw after that one.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import qprobe
from qprobe.kernel.kaslr import Decompressed

from .conftest import IMAGE, workload_result
from .guest_oracle import TRACING

pytestmark = pytest.mark.vm
# Boot-time probes stop the VM at every initcall while the booting kernel patches its own text; under QEMU
# 7.2's multi-threaded TCG one such boot of debian-cloud-6.12 double-faulted in __kmalloc_cache_node on the
# other vCPU (docs/reliability.md): these VMs run both vCPUs on one TCG thread, as test_oracle's do.
TCG = "single"
ROOT = Path(__file__).resolve().parents[2]
SMP = 2

# initcall_debug's lines (init/main.c's trace_initcall_start_cb and trace_initcall_finish_cb).  The PCI
# fixups' "calling  quirk+0x0/0x.. @ 1 for 0000:00:00.0" lines (drivers/pci/quirks.c) are no initcall.
# A line's timestamp is there with CONFIG_PRINTK_TIME.
CALLING = re.compile(r"^(?:\[[^]]*\] )?calling  (\S+) @ (\d+)$", re.M)
RETURNED = re.compile(r"^(?:\[[^]]*\] )?initcall (\S+) returned (-?\d+) after \d+ usecs$", re.M)


# The kernel's log, then its boot-time event's count (a kernel without kprobe events says so).
GUEST = (f"dmesg; if [ -e {TRACING}/kprobe_profile ]; then cat {TRACING}/kprobe_profile; "
         "else echo no kprobe events; fi")  # fmt: skip
PROFILE = re.compile(r"^\s*kic\s+(\d+)\s+(\d+)$", re.M)


def _s32(value: int) -> int:
    """An initcall's int return value from the 64-bit register $retval reads."""
    value &= 0xFFFF_FFFF
    return value - (1 << 32) if value >> 31 else value


def _kernel_initcalls(dmesg: str) -> list[tuple[str, int]]:
    """(function, return value) of every initcall do_one_initcall ran, in the order the kernel ran them.

    console_init() runs the console initcalls itself, from start_kernel (pid 0, before there is a
    pid 1), logging them alike: they are not do_one_initcall's.
    """
    events = sorted([(m.start(), "call", m.group(1), int(m.group(2))) for m in CALLING.finditer(dmesg)]
                    + [(m.start(), "ret", m.group(1), int(m.group(2))) for m in RETURNED.finditer(dmesg)])  # fmt: skip
    open_calls: list[tuple[str, int]] = []
    out: list[tuple[str, int]] = []
    for _pos, kind, fn, value in events:
        if kind == "call":
            open_calls.append((fn, value))
            continue
        i = max(i for i, (name, _pid) in enumerate(open_calls) if name == fn)
        _name, pid = open_calls.pop(i)
        if pid != 0:
            out.append((fn, value))
    assert not open_calls, open_calls
    return out


def test_boot_trace_lists_the_kernel_s_initcalls_and_its_cpus_bring_up() -> None:
    check_boot_trace(boot_trace("%di", "start_secondary", "--tcg-thread", TCG))


def boot_trace(first_arg: str, secondary: str, *options: str) -> subprocess.CompletedProcess[str]:
    """``trace --boot --json --run GUEST`` of do_one_initcall's entry (its function argument, in the register
    ``first_arg``) and return, start_kernel and ``secondary`` (where the kernel brings up a secondary CPU)."""
    return subprocess.run(
        [sys.executable, "-m", "qprobe.cli", "trace", "--image", IMAGE, "--smp", str(SMP), *options, "--boot",
         "--json", "--cmdline", "initcall_debug log_buf_len=8M kprobe_event=p:kic,do_one_initcall", "--run", GUEST,
         f"p:ic do_one_initcall fn={first_arg}:symbol", "r:icr do_one_initcall ret=$retval",
         "p:sk start_kernel", f"p:ss {secondary}"],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip


def check_boot_trace(out: subprocess.CompletedProcess[str]) -> None:
    """``trace --boot --json --run GUEST`` of do_one_initcall's entry and return, start_kernel and
    start_secondary, against the kernel's own account of the same boot (in --run's output)."""
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    hits, summary = rows[:-1], rows[-1]["summary"]
    kernel = _kernel_initcalls(out.stderr)  # --run's output (dmesg) goes to stderr
    assert len(kernel) > 100, out.stderr[-3000:]

    # One task runs the initcalls, one at a time: entries and returns pair in order.
    calls: list[str] = []
    seen: list[tuple[str, int]] = []
    for hit in hits:
        if hit["event"] == "ic":
            calls.append(hit["args"]["fn"])
        elif hit["event"] == "icr":
            seen.append((calls[len(seen)], _s32(hit["args"]["ret"])))
    assert len(calls) == len(seen) == summary["ic"]["hits"] == summary["icr"]["hits"]
    assert seen == kernel
    assert summary["ic"]["nmissed"] == summary["icr"]["nmissed"] == 0

    assert [h["cpu"] for h in hits if h["event"] == "sk"] == [0]
    assert sorted(h["cpu"] for h in hits if h["event"] == "ss") == list(range(1, SMP))
    assert hits[0]["event"] == "sk"  # before anything else traced

    profile = PROFILE.search(out.stderr)
    created = [i for i, fn in enumerate(calls) if fn.startswith("init_kprobe_trace+")]
    if not created:  # a kernel without kprobe events (minimal-6.12)
        assert profile is None and "no kprobe events" in out.stderr, out.stderr[-2000:]
        return
    # Its own boot-time event counts what qprobe saw after init_kprobe_trace created it, and missed none.
    assert profile is not None, out.stderr[-2000:]
    assert int(profile.group(1)) == len(calls) - created[0] - 1 > 0
    assert int(profile.group(2)) == 0


def test_probes_in_init_text_are_retired_when_the_kernel_frees_it() -> None:
    # kernel_init_freeable and start_kernel are __init and run once; kernel_init (__ref: kept text) calls
    # the first, then frees __init memory.
    init_fn = qprobe.Kprobe("kernel_init_freeable")
    boot_fn = qprobe.Kprobe("start_kernel")
    kept = qprobe.Kprobe("kernel_init")
    # What stays on stub breakpoints once booted: a probe asked so, a kretprobe, a notrace function's event.
    asked = qprobe.Kprobe("do_one_initcall", anywhere=True)
    ret = qprobe.Kretprobe("do_one_initcall")
    with qprobe.boot(
        IMAGE, tcg_thread=TCG, probes=[init_fn, boot_fn, kept, asked, ret, "p:ss start_secondary"]
    ) as target:
        listing = target.list_probes()
        assert init_fn.gone and boot_fn.gone and not kept.gone, listing
        assert init_fn.nhit == boot_fn.nhit == kept.nhit == 1, listing  # counts kept
        lines = {line.split()[2].split("+")[0]: line for line in listing.splitlines()}
        assert lines["kernel_init_freeable"].endswith("[ANYWHERE][GONE]"), listing
        assert "[ANYWHERE]" not in lines["kernel_init"], listing  # kept text: on the int3 path once booted
        # A kprobe event on start_secondary (notrace) is the kernel's to refuse: with dynamic ftrace it does.
        events = f"{TRACING}/kprobe_events"
        refused = False
        if target.run(f"test -e {events}").status == 0:
            refused = target.run(f"echo 'p:t start_secondary' >> {events}").status != 0
            target.run(f"echo '-:t' >> {events} 2>/dev/null")
        assert lines["start_secondary"].endswith("[ANYWHERE]") == refused, listing
        stubs = [line for line in listing.splitlines() if " do_one_initcall+" in line]  # __init without modules
        assert len(stubs) == 2 and all("[ANYWHERE]" in line for line in stubs), listing
        assert asked.anywhere and ret.kp.anywhere and ret.nhit == ret.nreturns == asked.nhit > 100, listing
        # Those still in are on stub breakpoints (QEMU keeps a killed client's: a later attach drops every
        # vCPU's, the gdbstub's own cleanup reaching one only), do_one_initcall's until its __init text goes.
        armed = [point.addr for point in target.kprobes.stubs.points.values() if point.armed]
        assert asked.gone or asked.resolved in armed  # do_one_initcall is __init without modules
        with pytest.raises(qprobe.QprobeError, match="not in kernel text"):
            target.register_kprobe(qprobe.Kprobe("kernel_init_freeable", anywhere=True))
        target.unregister_kprobe(init_fn)
        assert "kernel_init_freeable" not in target.list_probes()


def test_a_boot_probe_moves_to_the_int3_path_once_booted_and_counts_on() -> None:
    # The guest's init script is a shell, which calls getppid as it starts (busybox ash sets $PPID): hits
    # on the stub breakpoint during boot.  The guest shell then runs commands without calling it, so a
    # workload's N getppid calls are N more hits, on the int3 path.  No process runs before fs_initcall,
    # where the kernel's own boot-time event on the same function starts counting: it counts them all.
    fn = "__x64_sys_getppid"
    seen: list[tuple[int, bytes]] = []  # the function's text at a boot-time hit, when nothing was written yet

    def at_hit(kp: qprobe.Kprobe, regs: qprobe.PtRegs) -> int:
        if not seen:
            seen.append((regs.ip, regs.read(regs.ip, 64)))
        return 0

    kp = qprobe.Kprobe(fn, pre_handler=at_hit)
    n = 300
    with qprobe.boot(IMAGE, tcg_thread=TCG, probes=[kp], cmdline=f"kprobe_event=p:gp,{fn}") as target:
        listing = target.list_probes()
        line = next(x for x in listing.splitlines() if f" {fn}+" in x)
        assert "[ANYWHERE]" not in line and not kp.anywhere, listing
        booted = kp.nhit
        assert booted > 0 and seen, listing
        ip, text = seen[0]
        assert text[0] != 0xCC
        res = workload_result(target.run(f"workload getppid {n}").check().output)
        assert res["errors"] == "0"
        target.list_probes()  # an optimized probe's hits counted
        assert kp.nhit - booted == n and kp.nmissed == 0, target.list_probes()
        profile = target.run(f"cat {TRACING}/kprobe_profile 2>/dev/null || echo no kprobe events").output
        count = re.search(r"^\s*gp\s+(\d+)\s+(\d+)$", profile, re.M)
        if count is None:  # a kernel without kprobe events (minimal-6.12)
            assert "no kprobe events" in profile, profile
        else:
            assert (int(count.group(1)), int(count.group(2))) == (kp.nhit, 0), (profile, booted)
        target.unregister_kprobe(kp)
        assert target.read(ip, 64) == text
        assert target.oopses() == []


def _kernel_says(target: qprobe.Target) -> tuple[int, int]:
    """The running kernel's own account: where its text is physically (/proc/iomem's "Kernel code") and
    start_kernel's address (/proc/kallsyms)."""
    out = target.run("grep 'Kernel code' /proc/iomem; grep ' start_kernel$' /proc/kallsyms").output
    code = re.search(r"^\s*([0-9a-f]+)-[0-9a-f]+ : Kernel code$", out, re.M)
    sym = re.search(r"^([0-9a-f]+) [Tt] start_kernel$", out, re.M)
    assert code is not None and sym is not None and int(sym.group(1), 16), out
    return int(code.group(1), 16), int(sym.group(1), 16)


def test_the_slide_is_found_from_the_kernel_s_physical_entry() -> None:
    # The watch on guest RAM finds the decompressed vmlinux where the kernel then runs physically, and the
    # one breakpoint on its physical entry sees the kernel in before it reaches its virtual addresses.
    start = qprobe.Kprobe("start_kernel")
    with qprobe.boot(IMAGE, tcg_thread=TCG, probes=[start]) as target:
        phys_text, start_kernel = _kernel_says(target)
        assert target.boot_slide.method == "entry"
        assert target.boot_slide.output == phys_text
        assert target.symbols.address("start_kernel") == start_kernel
        assert start.nhit == 1


def test_a_missed_header_falls_back_to_every_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    # The watch never recognises the decompressed header (as if it looked only once the text had been
    # moved over it): it finds the kernel in place, and every candidate goes in before the virtual entry.
    monkeypatch.setattr(Decompressed, "header_at", lambda self, read, output: False)
    start = qprobe.Kprobe("start_kernel")
    with qprobe.boot(IMAGE, tcg_thread=TCG, probes=[start]) as target:
        _phys_text, start_kernel = _kernel_says(target)
        assert target.boot_slide.method == "late"
        assert target.symbols.address("start_kernel") == start_kernel
        assert start.nhit == 1
