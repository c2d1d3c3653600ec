"""With only in-guest uprobes of qprobe's armed, a guest that toggles its own uprobe event under QEMU's default,
multi-threaded TCG keeps answering.

Enabling or disabling the guest's first trace event patches the sched_switch tracepoint through text_poke_bp,
and QEMU 7.2's MTTCG can leave a vCPU executing a stale translation of the int3 that text_poke_bp has already
replaced: the kernel's int3 handler backs up over it and runs it again, forever, interrupts off
(docs/reliability.md).  qprobe's trap hook steps such an int3 away; its uprobes counted in the guest arm no
kprobe, but keep the hook (a watchpoint in poke_int3_handler, which a user-mode int3 never reaches, so their
hits still stop nothing).  Unlike the other modules that enable guest uprobe events, this one boots its VM
on QEMU's default TCG threads on purpose (tests/unit/test_vm_tcg_thread.py names it).
"""

from __future__ import annotations

import pytest

import qprobe
from qprobe import Uprobe

from .conftest import IMAGE
from .guest_oracle import TRACING
from .test_uprobe_inguest import calls_of
from .test_uprobe_lifecycle import PROG, file_offset, ok, run, wait_for

pytestmark = [pytest.mark.vm, pytest.mark.qprobe_needs_config("UPROBE_EVENTS")]

# Rounds of the probed program while the guest toggles its event: without the hook the guest wedged after 672
# and after 223 such rounds (two boots, debian-cloud, smp 2).
ROUNDS = 1000
TOGGLE = (f"(while [ ! -e /tmp/toggle.stop ]; do echo 1 > {TRACING}/events/uprobes/qpig/enable; "
          f"echo 0 > {TRACING}/events/uprobes/qpig/enable; done; echo toggled) > /tmp/toggle.out 2>&1 &")  # fmt: skip


def test_a_guest_toggling_its_own_uprobe_event_keeps_answering_with_only_in_guest_uprobes_armed() -> None:
    off = file_offset(PROG, "qpt_target")
    with qprobe.boot(IMAGE) as t:  # QEMU's default: one TCG thread per vCPU
        up = Uprobe(PROG, off, in_guest=True)
        t.register_uprobe(up)
        t.run(f"echo 'p:uprobes/qpig {PROG}:{off:#x}' > {TRACING}/uprobe_events && rm -f /tmp/toggle.stop").check()
        t.run(TOGGLE).check()
        calls = 0
        for _ in range(ROUNDS):
            out = run(t, "uprog threads 3 20")
            ok(out)
            calls += calls_of(out)
        t.run("touch /tmp/toggle.stop").check()
        wait_for(t, "/tmp/toggle.out", r"^toggled$")  # the loop saw the stop and ended
        t.run(f"echo 0 > {TRACING}/events/uprobes/qpig/enable; echo > {TRACING}/uprobe_events").check()
        assert up.nhit == calls and calls > 0
        assert t.oopses() == [], t.console.tail(60)  # type: ignore[union-attr]
        t.unregister_uprobe(up)
