"""An int3 that is not qprobe's and is gone from the text by the time its trap is seen."""

from __future__ import annotations

import pytest

import qprobe
from qprobe.vmm.memory import SharedRam

from .conftest import workload_result

pytestmark = pytest.mark.vm


# The watchpoint hook watches text_poke_bp's bp_desc.refs, read in poke_int3_handler (qprobe.arch.x86_64's
# TRAP_WATCH): a kernel without them has no such hook, which is the kernel's fact, not qprobe's.
@pytest.mark.qprobe_needs_symbol("bp_desc", "poke_int3_handler")
def test_a_stale_foreign_int3_runs_the_text_as_it_is_now(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    """QEMU 7.2 can keep executing a stale translation of an int3 the guest already patched away.

    Made here on purpose: an int3 is written into ksys_lseek through the gdbstub (QEMU
    translates it), and when its trap reaches qprobe's hook the original byte is put back
    through guest RAM, which QEMU's translated code does not see.  The kernel's own #BP
    handler would back up into the stale int3 forever; qprobe backs up and steps, which
    makes QEMU translate the text again.  The workload then runs to the end.
    """
    kprobes = target.kprobes
    hook = qprobe.Kprobe(symbol_name="do_sys_openat2")  # any probe: it puts the int3 hook in place
    target.register_kprobe(hook)
    probe = qprobe.Kprobe(symbol_name="ksys_lseek")  # where qprobe would probe: an instruction boundary
    target.register_kprobe(probe)
    site = probe.resolved
    target.unregister_kprobe(probe)
    ram = kprobes.machine.data_writer
    # The plugin's own QEMU always shares the guest's RAM, and a kernel with the symbols above gets the hook.
    assert kprobes.dispatcher.watch_refs, "qprobe put no watchpoint hook on bp_desc.refs"
    assert isinstance(ram, SharedRam), f"the guest's RAM is not shared with qprobe: {ram!r}"
    original = target.read(site, 1)
    phys = target.mem.virt_to_phys(site)
    handler = kprobes.machine.watch_handlers[kprobes.dispatcher.watch_refs]
    forged = []

    def forge_the_stale_translation(tid: str, regs: dict[str, int]) -> None:
        if target.mem.read(site, 1) == b"\xcc":
            ram.write_phys(phys, original)  # behind QEMU's back: its translation keeps the int3
            forged.append(tid)
        handler(tid, regs)

    before = kprobes.dispatcher.stale_int3
    # Both ways a watched trap arrives: its own stop, and the look after any stop (a lost one).
    kprobes.machine.watch_handlers[kprobes.dispatcher.watch_refs] = forge_the_stale_translation
    kprobes.dispatcher.on_watch_stop = forge_the_stale_translation  # type: ignore[method-assign]
    try:
        # Journaled as qprobe's own writes are, so it is undone even if the guest wedges here.
        int3 = kprobes.machine.call(lambda: kprobes.machine.patch(site, b"\xcc", "a foreign int3 (test)"))
        res = workload_result(target.run("workload lseek 3", timeout=60).check().output)
    finally:
        kprobes.machine.watch_handlers[kprobes.dispatcher.watch_refs] = handler
        del kprobes.dispatcher.on_watch_stop
        kprobes.machine.call(lambda: kprobes.machine.unpatch(int3))
        target.unregister_kprobe(hook)
    assert forged, "the int3 never trapped"
    assert res["ret"] == "3" and res["errors"] == "0"
    assert kprobes.dispatcher.stale_int3 - before == len(forged) == 1
    assert target.oopses() == []
