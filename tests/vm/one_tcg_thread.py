"""The VM of a module whose tests enable the guest kernel's own trace events, booted on one TCG thread.

Enabling the guest's first event (a uprobe event too) starts the kernel's cmdline recording, which
registers a probe on the sched_switch tracepoint, and disabling its last one stops it: each time the
tracepoint's static key and static call are patched through text_poke_bp.  Under QEMU 7.2's
multi-threaded TCG a vCPU can then keep running a stale translation of the int3 text_poke_bp already
replaced, looping in the kernel's int3 handler with interrupts off while the other waits in
text_poke_bp's IPI: the guest never answers again (docs/reliability.md).  Where qprobe has no kprobe
armed, its trap hook, which steps such an int3 away, is not there to end the loop.  With one TCG
thread no vCPU runs translated code while the other rewrites it.
"""

from __future__ import annotations

from typing import Any

import pytest

from qprobe.pytest_plugin import qprobe_scope


@pytest.fixture(scope=qprobe_scope)
def qprobe_boot_kwargs() -> dict[str, Any]:
    """Both vCPUs of the importing module's VM on one TCG thread."""
    return {"tcg_thread": "single"}


__all__ = ["qprobe_boot_kwargs"]
