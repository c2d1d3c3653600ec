"""Probes on module functions: pending until the module loads, killed when it unloads, back when it reloads.

The module is ``binfmt_misc`` from the image's own kernel package, loaded with
busybox ``insmod``.  Each ``dd bs=N count=1`` of its ``status`` file is exactly
one ``read()``, so exactly one call of ``bm_status_read(file, buf, nbytes=N,
ppos)``: the counts and the ``nbytes`` values are what the guest did.  Verdicts
are compared with the guest's own kprobe_events in the same VM (without
enabling its events, which are not needed for a verdict).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lief
import pytest

import qprobe
from qprobe.events import add_event, remove_events
from qprobe.events.funcs import Probeability, render_funcs
from qprobe.images import get_image, module_file
from qprobe.pytest_plugin import qprobe_scope

from .guest_oracle import TRACING, guest_verdicts, qprobe_verdicts, readme_lacks

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
    te = add_event(target.event_api, defs[0], callback=lambda hit: seen.append(int(hit.args["n"])))
    ret = add_event(target.event_api, defs[1])
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
        # Where the guest's language has BTF arguments: names and types from the module's own BTF (6.12's
        # bpf_find_btf_id).  Asked of the guest's README, not of qprobe, whose language is under test.
        btf_args = readme_lacks(target, "btf_args") is None
        if btf_args:
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
        te = add_event(target.event_api, f"p:plain bm_status_read n=%dx:u64 fl=+{flags}(%di):x32")
        values: list[dict[str, str]] = []
        te.callback = lambda hit: values.append(dict(hit.args))
        _read(target, [7, 8, 9])
        assert [v["n"] for v in values] == ["7", "8", "9"]
        # The struct file dd opened: O_RDONLY, and the O_LARGEFILE a 64-bit kernel adds to every open.
        assert [v["fl"] for v in values] == ["0x8000"] * 3
        remove_events([te])
        if btf_args:
            te = add_event(target.event_api, "p:named bm_status_read nbytes fl=file->f_flags:x32")
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


def _init_and_exit(ko: Path) -> tuple[str, str]:
    """The functions ``module_init`` and ``module_exit`` name, from the module's own symbol table: the
    ``init_module`` and ``cleanup_module`` aliases those macros define sit at their addresses."""
    elf = lief.ELF.parse(str(ko))  # kept: its symbols are views into it
    assert elf is not None, ko
    syms = list(elf.symbols)
    alias = {s.name: (s.shndx, s.value) for s in syms if s.name in ("init_module", "cleanup_module")}
    init, exit_ = (next(s.name for s in syms if s.name and s.name != name and (s.shndx, s.value) == alias[name])
                   for name in ("init_module", "cleanup_module"))  # fmt: skip
    return init, exit_


def test_init_and_exit_functions_across_two_loads_as_the_kernel_s_own_events(
    qprobe_target: qprobe.Target, qprobe_image: str
) -> None:
    """``MOD:init_fn`` defined before the module exists: armed while it is COMING, hit once per load, its
    return value the init's own, killed ([GONE], count kept, bytes back) once the module is LIVE and its
    init text is to be freed, as ``kprobes_module_callback`` kills the kernel's; armed again on the next load.

    The oracle is the guest's own events on the same functions, defined before the first load:
    ``trace_kprobe_module_callback`` registers them on each load, ``kprobe_profile`` counts their hits,
    ``trace`` holds the init's return value, and its log says whether it refused the exit function
    (``.exit.text`` has no ``__fentry__`` site: notrace, for kprobe events).  A plain kprobe, which the
    kernel puts on a notrace function, counts the one call of the exit function each unload makes.
    """
    target = qprobe_target
    init_fn, exit_fn = _init_and_exit(module_file(get_image(qprobe_image), MODULE))
    assert MODULE not in target.run("cat /proc/modules").output
    guest = [f"p:kev {MODULE}:{init_fn}", f"r:kret {MODULE}:{init_fn} rv=$retval:s32", f"p:kexit {MODULE}:{exit_fn}"]
    enable = f"{TRACING}/events/kprobes/{{}}/enable"
    names = [d[2:].split()[0] for d in guest]
    on = " && ".join(
        f"echo '{d}' >> {TRACING}/kprobe_events && echo 1 > {enable.format(n)}"
        for d, n in zip(guest, names, strict=True)
    )
    target.run(f"{on} && echo > {TRACING}/trace").check()
    refusal = f"Failed to re-register probe kexit on {MODULE}"
    refused_before = target.run("dmesg").check().output.count(refusal)
    entry = add_event(target.event_api, f"p:qev {MODULE}:{init_fn}")
    values: list[str] = []
    ret = add_event(
        target.event_api,
        f"r:qret {MODULE}:{init_fn} rv=$retval:s32",
        callback=lambda hit: values.append(hit.args["rv"]),
    )
    exit_event = add_event(target.event_api, f"p:qexit {MODULE}:{exit_fn}")
    assert entry.probe is None and ret.probe is None and exit_event.probe is None  # pending
    hooks = set(target.kprobes.text.patched())  # qprobe's own, on the module notifier's functions
    exits: list[qprobe.Kprobe] = []
    try:
        for load in (1, 2):
            _load(target)
            module = target.symbols.modules[MODULE]
            listing = target.list_probes()
            assert entry.nhit == ret.nhit == load and values == ["0"] * load, listing
            assert entry.probe is not None and entry.probe.gone and not entry.probe.registered, listing
            gone = [line.split()[:2] for line in listing.splitlines() if "[GONE]" in line]
            assert sorted(gone) == [[f"{entry.probe.at:016x}", "k"], [f"{entry.probe.at:016x}", "r"]], listing
            # Its init symbols went with the init text (kallsyms switched to the core ones): -ENOENT.
            assert not module.lookup(init_fn) and module.lookup(exit_fn)
            with pytest.raises(qprobe.QprobeError, match="unknown symbol"):
                target.register_kprobe(qprobe.Kprobe(f"{MODULE}:{init_fn}"))
            # Nothing qprobe wrote is left in the init text the kernel frees.
            assert all(module.is_text(a) for a in set(target.kprobes.text.patched()) - hooks), listing
            exits.append(qprobe.Kprobe(f"{MODULE}:{exit_fn}"))
            target.register_kprobe(exits[-1])
            _unload(target)
            assert exits[-1].nhit == 1 and exits[-1].gone, target.list_probes()
            assert f"{exits[-1].at:016x}  k  " in target.list_probes()
            target.unregister_kprobe(exits[-1])  # a killed probe unregisters, as the kernel's does
            assert "[GONE]" in target.list_probes() and f"{exits[-1].at:016x}  k  " not in target.list_probes()
            assert set(target.kprobes.text.patched()) == hooks, "a write left in the freed module"
        profile = target.run(f"cat {TRACING}/kprobe_profile").check().output
        trace = target.run(f"cat {TRACING}/trace").check().output
        log = target.run("dmesg").check().output
    finally:
        off = "; ".join(f"echo 0 > {enable.format(n)}" for n in names)
        target.run(f"{off}; echo > {TRACING}/kprobe_events")
        remove_events([entry, ret, exit_event])
        target.events.clear()
    assert "[GONE]" not in target.list_probes()
    counts = {f[0]: int(f[1]) for f in (line.split() for line in profile.splitlines()) if len(f) == 3}
    assert counts == {"kev": 2, "kret": 2, "kexit": exit_event.nhit}, profile
    assert re.findall(r" kret: .* rv=(\S+)", trace) == ["0", "0"], trace  # the init's own return, twice
    assert values == ["0", "0"]
    refused = log.count(refusal) - refused_before
    assert refused == sum(f"Failed to re-register probe qexit on {MODULE}" in e for e in exit_event.errors), log
    assert target.oopses() == []


def test_an_init_function_defined_before_the_kernel_s_first_instruction(qprobe_image: str) -> None:
    """``qprobe trace --boot`` on ``MOD:init_fn``: armed before the kernel runs, the module notifier's own
    hooks are stub breakpoints, as every probe armed then is; the probe is armed on each load, hit once,
    killed once the module is LIVE."""
    image = get_image(qprobe_image)
    if image.config_option("BINFMT_MISC") != "m":
        pytest.skip(f"{qprobe_image}: binfmt_misc is not a module in this kernel")
    ko = module_file(image, MODULE)
    init_fn, _exit_fn = _init_and_exit(ko)
    with qprobe.boot(qprobe_image, probes=[f"p:qev {MODULE}:{init_fn}"], files={KO: ko}) as target:
        te = target.events["kprobes/qev"]
        assert te.probe is None  # pending
        for load in (1, 2):
            _load(target)
            assert te.nhit == load and te.probe is not None and te.probe.gone, target.list_probes()
            # The stub breakpoint in the init text went with the probe: only the notifier's hooks are left.
            assert all(target.symbols.module_of(a) is None for a in target.kprobes.stubs.points)
            _unload(target)
        assert target.oopses() == []
