"""Probes on an IBT kernel's functions: a probe asked for at an ``endbr64`` entry is the kernel's
``func+4`` (arch_adjust_kprobe_addr, Linux 5.18's "x86/ibt,kprobes: Cure sym+0 equals fentry
woes"), and neither its int3 nor its jump ever covers the ENDBR, which an indirect call must land on.

Gated on the running text's bytes, not on the image: a function that does not start with an ENDBR
(a kernel built without CONFIG_X86_KERNEL_IBT, such as minimal-6.12) is skipped, naming the image.
"""

from __future__ import annotations

import time

import pytest

import qprobe
from qprobe import Kprobe

from .conftest import IMAGE, workload_result

pytestmark = pytest.mark.vm
N = 5
ENDBR64 = bytes.fromhex("f30f1efa")
# What boot writes over an ENDBR no indirect call may reach, where the CPU has IBT: "osp nopl (%rax)"
# (apply_seal_endbr, arch/x86/include/asm/ibt.h); is_endbr() takes both as an ENDBR.
ENDBR_POISON = bytes.fromhex("660f1f00")
# function -> (workload command, exact entry count or None for "at least N")
FUNCS = {
    "vfs_read": (f"workload read {N} 64", None),
    "__x64_sys_lseek": (f"workload lseek {N}", N),
    "__x64_sys_getppid": (f"workload getppid {N}", N),
}


def _settled(target: qprobe.Target, addr: int, timeout: float = 10.0) -> None:
    """Wait while the point is still queued for the optimizer (its thread retries a held-up jump)."""
    point = target.kprobes.points[addr]
    deadline = time.monotonic() + timeout
    while point.opt is None and point.optimizing and time.monotonic() < deadline:
        time.sleep(0.05)


def _endbr_head(target: qprobe.Target, func: str) -> bytes | None:
    """The ENDBR (or its sealed form) ``func`` starts with in the running text, or None."""
    head = target.read(target.symbols.lookup(func).addr, 4)
    return head if head in (ENDBR64, ENDBR_POISON) else None


def _no_endbr(target: qprobe.Target, func: str) -> str:
    """Why ``func`` has no ENDBR, naming the config option (the fact an image is listed as lacking)."""
    image = target.image.name if target.image is not None else IMAGE
    head = target.read(target.symbols.lookup(func).addr, 4)
    option, config = "CONFIG_X86_KERNEL_IBT", target.image
    built = "unknown: no kernel config" if config is None or config.config is None else config.config_option(option)
    return f"image {image}: {func} starts with {head.hex()}, not an ENDBR ({option}: {built or 'not set'})"


def _probe_the_entry(target: qprobe.Target, func: str) -> tuple[Kprobe, Kprobe, int]:
    """A probe on ``func`` by name and one by address, registered; (by name, by address, where they are armed)."""
    fn = target.symbols.lookup(func)
    by_name, by_addr = Kprobe(symbol_name=func), Kprobe(addr=fn.addr)
    target.register_kprobe(by_name)
    target.register_kprobe(by_addr)
    entry = fn.addr + len(ENDBR64)
    # Armed there, or on the next instruction where that is the __fentry__ site the guest's ftrace owns.
    armed = entry + 5 if target.kprobes.sites.ftrace_site(entry) else entry
    _settled(target, armed)
    return by_name, by_addr, armed


@pytest.mark.parametrize("func", list(FUNCS))
def test_a_probe_at_an_endbr_entry_arms_after_it_and_no_jump_covers_it(
    target: qprobe.Target, guard: dict[int, bytes], func: str
) -> None:
    cmd, exact = FUNCS[func]
    fn = target.symbols.lookup(func)
    head = _endbr_head(target, func)
    if head is None:
        pytest.skip(_no_endbr(target, func))
    by_name, by_addr, armed = _probe_the_entry(target, func)
    try:
        entry = fn.addr + len(ENDBR64)
        # Where the kernel's own probe would be, and where it is listed.
        assert by_name.at == by_addr.at == entry
        listed = [x for x in target.list_probes().splitlines() if x.startswith(f"{entry:016x}  k  ")]
        assert len(listed) == 2 and all(x.split()[2] == f"{func}+0x4" for x in listed), listed
        assert by_name.resolved == by_addr.resolved == armed
        point = target.kprobes.points[armed]
        if point.opt is not None:
            assert point.addr >= entry  # the jump's displaced bytes start after the ENDBR
        assert target.read(fn.addr, 4) == head  # the running text, with the int3 or the jump in place
        res = workload_result(target.run(cmd).check().output)
        assert target.read(fn.addr, 4) == head
    finally:
        target.unregister_kprobe(by_name)
        target.unregister_kprobe(by_addr)
    assert int(res["errors"]) == 0
    for kp in (by_name, by_addr):
        assert kp.nhit == exact if exact is not None else kp.nhit >= N
        assert kp.nmissed == 0


def test_the_optimizer_took_an_endbr_entry(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    """At least one of the entries above is jump-optimized, so 'no jump covers the ENDBR' is tested.

    It registers the same probes as the tests above itself and looks at their points once the optimizer
    is done, instead of collecting what those tests saw: run alone, or without them, it checks the same
    thing and cannot pass or skip for want of them.
    """
    tested = [f for f in FUNCS if _endbr_head(target, f) is not None]
    if not tested:
        pytest.skip("; ".join(_no_endbr(target, f) for f in FUNCS))
    optimized = []
    for func in tested:
        by_name, by_addr, armed = _probe_the_entry(target, func)
        try:
            point = target.kprobes.points[armed]
            if point.opt is not None:
                optimized.append(func)
                assert point.addr >= target.symbols.lookup(func).addr + len(ENDBR64), func
        finally:
            target.unregister_kprobe(by_name)
            target.unregister_kprobe(by_addr)
    assert optimized, f"none of {tested} was jump-optimized: the jump next to an ENDBR went untested"
