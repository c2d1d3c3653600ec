"""Probes on module functions: pending until the module loads, killed when it unloads, back when it reloads.

The module is ``binfmt_misc`` from the image's own kernel package, loaded with
busybox ``insmod``.  Each ``dd bs=N count=1`` of its ``status`` file is exactly
one ``read()``, so exactly one call of ``bm_status_read(file, buf, nbytes=N,
ppos)``: the counts and the ``nbytes`` values are what the guest did.  Verdicts
are compared with the guest's own kprobe_events in the same VM (without
enabling its events, which are not needed for a verdict).
"""

from __future__ import annotations

from typing import Any

import pytest

import qprobe
from qprobe.events import add_event, remove_events
from qprobe.events.funcs import Probeability, render_funcs
from qprobe.images import get_image, module_file
from qprobe.pytest_plugin import qprobe_scope

from .guest_oracle import TRACING, guest_verdicts, qprobe_verdicts

pytestmark = [pytest.mark.vm, pytest.mark.qprobe_needs_symbol("do_init_module", "free_module")]

MODULE = "binfmt_misc"
KO = "/binfmt_misc.ko"
READ = "dd if=/bm/status of=/dev/null bs={bs} count=1 2>/dev/null"


@pytest.fixture(scope=qprobe_scope)
def qprobe_boot_kwargs(qprobe_image: str) -> dict[str, Any]:
    image = get_image(qprobe_image)
    if image.config_option("BINFMT_MISC") != "m":
        pytest.skip(f"{qprobe_image}: binfmt_misc is not a module in this kernel")
    return {"files": {KO: module_file(image, MODULE)}}


def _load(target: qprobe.Target) -> None:
    target.run(f"insmod {KO} && mkdir -p /bm && mount -t {MODULE} none /bm").check()


def _unload(target: qprobe.Target) -> None:
    target.run(f"umount /bm && rmmod {MODULE}").check()


def _read(target: qprobe.Target, sizes: list[int]) -> None:
    target.run("; ".join(READ.format(bs=bs) for bs in sizes)).check()


def test_module_probe_pending_loaded_gone_and_back(qprobe_target: qprobe.Target) -> None:
    target = qprobe_target
    assert MODULE not in target.run("cat /proc/modules").output
    # Before the module exists both sides accept MOD:SYM and keep the probe pending,
    # including one whose offset turns out not to be an entry (refused only on load): +1 is inside
    # the first instruction, the __fentry__ call or an IBT kernel's ENDBR64 (after which +4 is the entry).
    defs = [f"p:qm {MODULE}:bm_status_read n=%dx:u64", f"r:qr {MODULE}:bm_status_read+1"]
    assert [str(case[0]) for case in guest_verdicts(target, [[d] for d in defs])] == ["OK", "OK"]
    seen: list[int] = []
    te = add_event(target, defs[0], callback=lambda hit: seen.append(int(hit.args["n"])))
    ret = add_event(target, defs[1])
    assert te.probe is None and ret.probe is None

    _load(target)
    sizes = [17, 512, 4096, 1]
    _read(target, sizes)
    assert te.probe is not None and te.nhit == len(sizes)
    assert seen == sizes
    assert ret.probe is None and any("Failed to re-register probe qr" in e for e in ret.errors)

    module = target.symbols.modules[MODULE]
    _unload(target)
    assert te.probe.gone and not te.probe.registered  # kill_kprobe: its count is kept
    assert MODULE not in target.symbols.modules
    assert not [a for a in target.kprobes.text.patched() if module.is_text(a)], "a write left in freed module memory"

    _load(target)
    _read(target, [99])
    assert te.nhit == len(sizes) + 1 and seen[-1] == 99
    remove_events([te])
    remove_events([ret])
    target.events.clear()
    _unload(target)
    assert target.oopses() == []


def test_loaded_module_verdicts_values_and_text(qprobe_target: qprobe.Target) -> None:
    target = qprobe_target
    _load(target)
    try:
        cases = [[f"p:a {MODULE}:nosuch"], [f"p:b {MODULE}:bm_status_read+1"], [f"p:c {MODULE}:bm_status_read+4"],
                 [f"p:d {MODULE}:bm_status_read"], ["p:e bm_status_read"], [f"r:f {MODULE}:bm_status_read"],
                 ["p:g nosuchmodule:nosuch"]]  # fmt: skip
        if target.dialect.btf_args:  # names and types from the module's own BTF (6.12's bpf_find_btf_id)
            cases += [[f"p:h {MODULE}:bm_status_read $arg*"], ["p:i bm_status_read nbytes buf"],
                      [f"r:j {MODULE}:bm_status_read nbytes $retval"], ["p:k bm_status_read file->f_flags"],
                      ["p:l bm_status_read nosuch"], ["p:m bm_status_read file->nosuch"]]  # fmt: skip
        kernel, ours = guest_verdicts(target, cases), qprobe_verdicts(target, cases)
        differ = [f"{c[0]}: kernel {k[0]} {k[0].listing}, qprobe {q[0]} {q[0].listing}"
                  for c, k, q in zip(cases, kernel, ours, strict=True) if k[0] != q[0]]  # fmt: skip
        assert not differ, "\n".join(differ)

        start = target.symbols.address(f"{MODULE}:bm_status_read")
        before = target.read(start, 64)
        flags = target.kernel.type_offset("struct file", "f_flags")
        te = add_event(target, f"p:plain bm_status_read n=%dx:u64 fl=+{flags}(%di):x32")
        values: list[dict[str, str]] = []
        te.callback = lambda hit: values.append(dict(hit.args))
        _read(target, [7, 8, 9])
        assert [v["n"] for v in values] == ["7", "8", "9"]
        # The struct file dd opened: O_RDONLY, and the O_LARGEFILE a 64-bit kernel adds to every open.
        assert [v["fl"] for v in values] == ["0x8000"] * 3
        remove_events([te])
        if target.dialect.btf_args:
            te = add_event(target, "p:named bm_status_read nbytes fl=file->f_flags:x32")
            values.clear()
            te.callback = lambda hit: values.append(dict(hit.args))
            _read(target, [5, 6])
            assert values == [{"nbytes": "5", "fl": "0x8000"}, {"nbytes": "6", "fl": "0x8000"}]
            remove_events([te])
        target.events.clear()
        assert target.read(start, 64) == before
    finally:
        _unload(target)
    assert target.oopses() == []


@pytest.mark.qprobe_needs_config("FUNCTION_TRACER")
def test_funcs_knows_a_loaded_modules_functions_as_the_guest_does(qprobe_target: qprobe.Target) -> None:
    """``funcs`` lists a loaded module's functions as ``name [module]``; its verdicts against the guest's own list.

    available_filter_functions holds exactly the functions with an ``__fentry__`` site, the ones whose
    kprobe events the kernel does not refuse as notrace, but for GCC's parts (``bm_status_read.cold``):
    within_notrace_func judges a suffixed symbol by its base.  binfmt_misc has no blacklisted or shared names.
    """
    target = qprobe_target
    _load(target)
    try:
        lines = target.run(f"grep ' \\[{MODULE}\\]$' {TRACING}/available_filter_functions").check().output
        guest = {line.split()[0] for line in lines.splitlines()}
        prob = Probeability.of_target(target)
        names = sorted({name for mod, name, _a, _s in prob.module_functions() if mod.name == MODULE})
        found = [f for f in prob.match(names) if f.module == MODULE]
        text, summary, _ = render_funcs(prob, ["bm_status_read"])
    finally:
        _unload(target)
    assert "bm_status_read" in guest
    copies = {f.name for f in found if "." in f.name and f.name.split(".", 1)[0] in guest}
    assert {f.name for f in found if f.probeable} == guest | copies
    assert all((f.reason or "").startswith("notrace") for f in found if not f.probeable)
    assert text == f"bm_status_read [{MODULE}]\n"
    assert summary == "1 function matches 'bm_status_read': 1 can be probed, 0 cannot"
