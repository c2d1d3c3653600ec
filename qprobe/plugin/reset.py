"""Around each test on a VM (``qprobe_reset``, ``QprobeReset``): its probes and events removed, the kernel
text qprobe patched checked byte for byte, the guest's oopses checked; a failing test's VM kept on
``--qprobe-keep``."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import pytest

from qprobe.plugin.state import _KEPT, _OUR_SKIP, _REPORTS, _Vm, _vm_of
from qprobe.plugin.vm import _user_kprobes

CONSOLE_TAIL = 40


class QprobeReset:
    """What the plugin does around one test that uses ``qprobe_target``.

    ``strict``: fail the test if it leaves a probe or event registered (they are
    removed either way).  ``watch(*functions)``: also check these functions'
    text, probed or not.  Functions qprobe patches during the test are
    snapshotted just before their first patch.
    """

    def __init__(self, vm: _Vm, item: pytest.Item) -> None:
        self.vm = vm
        self.item = item
        self.target = vm.target
        self.strict = False
        self.snapshots: dict[int, tuple[str, bytes]] = {}  # start -> (name, bytes before the test)
        self.snapshot_errors: list[str] = []  # text that could not be snapshotted, so cannot be checked
        self.module_text: dict[int, int] = {}  # snapshot start -> the struct module whose text it is
        self.oops_seen = len(self.target.oopses())
        self.handler_errors_seen = len(self.target.kprobes.handlers.errors)
        self.gone_said = False  # the test failed for the VM's death: teardown does not say it again

    # -- text snapshots ------------------------------------------------------------------
    def _pristine(self, start: int, size: int, only: set[int] | None = None) -> bytes:
        """Bytes at [start, start+size) as they are without qprobe's live patches (``only`` those at these
        addresses)."""
        data = bytearray(self.target.read(start, size))
        for p in self.target.journal.patches.values():
            if (only is None or p.virt in only) and start <= p.virt and p.virt + len(p.old) <= start + size:
                data[p.virt - start : p.virt - start + len(p.old)] = p.old
        return bytes(data)

    def _snapshot(self, addr: int) -> None:
        syms = self.target.symbols
        fn = syms.function(addr)
        if fn is not None:
            start, size, name = fn.addr, fn.size, fn.name
        elif syms.is_text(addr):
            start, size, name = addr - 16, 32, syms.symbolize(addr)
        else:
            return  # a stack slot (kretprobe) or a page-table entry (the scratch mapping)
        if start not in self.snapshots:
            self.snapshots[start] = (name, self._pristine(start, size))
            mod = syms.module_of(start)
            if mod is not None:
                self.module_text[start] = mod.struct_addr

    def watch(self, *functions: str) -> dict[int, bytes]:
        """Check these functions' text after the test too; returns {address: bytes now}."""
        out = {}
        for name in functions:
            sym = self.target.symbols.lookup(name)
            data = self._pristine(sym.addr, sym.size)
            self.snapshots.setdefault(sym.addr, (name, data))
            out[sym.addr] = data
        return out

    def start(self) -> None:
        # Every byte qprobe writes into the guest goes through Machine.patch (journaled
        # first): snapshot the function around it just before its first patch.
        self.target.machine.patch_watchers.append(self._before_patch)

    def _before_patch(self, virt: int) -> None:
        if virt in self._boot_sites():
            return  # a boot-time probe's text (optimized during the test): the VM's, not the test's
        try:
            self._snapshot(virt)
        except Exception as exc:  # the probe goes ahead; the test fails at the end, unchecked text is no pass
            self.snapshot_errors.append(f"{virt:#x}: {type(exc).__name__}: {exc}")

    def _boot_sites(self) -> set[int]:
        """Where the VM's boot-time probes, kept between tests, patch the text once they are on the int3 path."""
        return {kp.resolved for kp in _user_kprobes(self.target) if self.vm.at_boot(kp)}

    def _stop_watching(self) -> None:
        watchers = self.target.machine.patch_watchers
        if self._before_patch in watchers:
            watchers.remove(self._before_patch)

    # -- checks ------------------------------------------------------------------------
    def gone(self, exc: BaseException) -> str | None:
        """Why the VM is gone, if ``exc`` (the test's) came of its end; said then as the test's failure."""
        from qprobe.errors import GoneInterrupt, TargetGone

        if not isinstance(exc, GoneInterrupt | TargetGone):
            return None
        try:
            self.target.machine.check_alive(wait=2.0)  # the stop loop says why QEMU went
        except TargetGone as why:
            self.gone_said = True
            return str(why)
        return None

    def new_oopses(self) -> list[str]:
        lines = self.target.oopses()
        new, self.oops_seen = lines[self.oops_seen :], len(lines)
        return new

    def _remove_everything(self) -> list[str]:
        """Unregister every event, uprobe, kretprobe and kprobe still registered, but the VM's boot-time ones;
        what was left (kprobes/list lines)."""
        t, vm = self.target, self.vm
        if not vm.follows_modules():
            t.modules.stop()  # its own three probes are not the test's
        left = [repr(up) for up in t.uprobes.registered()]
        t.uprobes.remove_all()  # before the kretprobes: one of them follows new mappings for the uprobes
        # kprobes/list's lines but the boot-time probes' (one line a probe, led by its address and kind: where
        # it was asked on the int3 path, an [FTRACE] one before its __fentry__ site; where armed on a stub)
        hooks = t.modules.hooks  # the notifier's, kept for boot-time events on modules
        boot = [({f"{kp.at:016x}", f"{kp.resolved:016x}"}, "r" if kp.kretprobe is not None else "k")
                for kp in _user_kprobes(t) if vm.at_boot(kp) or any(kp is h for h in hooks)]  # fmt: skip
        for line in t.list_probes().splitlines():
            addr, kind = [*line.split(), "", ""][:2]
            mine = next((b for b in boot if addr in b[0] and kind == b[1]), None)
            if mine is not None:
                boot.remove(mine)
            elif line.strip():
                left.append(line)
        armed = []
        for key, te in list(t.events.items()):
            if vm.boot_events.get(key) is te:
                continue
            if te.registered:
                armed.append(te)
            else:
                t.events.pop(key, None)
        t.remove_events(armed)
        t.unregister_kretprobes([rp for rp in t.kretprobes.registered if not vm.at_boot(rp)])
        t.unregister_kprobes([kp for kp in _user_kprobes(t) if not vm.at_boot(kp) and not any(kp is h for h in hooks)])
        if not t.kprobes.enabled:
            t.set_kprobes_enabled(True)
        return left

    def finish(self) -> list[str]:
        """Undo and check everything; returns the problems found (empty: all is well)."""
        from qprobe.errors import QprobeError

        t = self.target
        problems: list[str] = []
        if self.snapshot_errors:
            problems.append("could not snapshot the kernel text qprobe patched, so it was not checked: "
                            + "; ".join(self.snapshot_errors))  # fmt: skip
        try:
            left = self._remove_everything()
            if left and self.strict:
                problems.append("the test left probes registered (removed now):\n  " + "\n  ".join(left))
            loaded = {m.struct_addr for m in t.symbols.modules.values()}
            kept = self._boot_sites()  # a boot-time probe's int3 or jump in a function the test probed too
            for start, (name, before) in sorted(self.snapshots.items()):
                owner = self.module_text.get(start)
                if owner is not None and owner not in loaded:
                    continue  # its module was unloaded: the text is gone (qprobe restored it before the free)
                now = self._pristine(start, len(before), kept)
                if now != before:
                    problems.append(_text_diff(name, before, now))
            # The boot-time probes' int3s and jumps are the VM's, and so, while any is in, the links that put
            # qprobe's entries on the guest's kprobe_blacklist.
            sites = self._boot_sites()
            leftovers = [f"{p.what} at {t.symbols.symbolize(p.virt)}" for p in t.journal.patches.values()
                         if p.what != "pmd" and p.virt not in sites
                         and not (sites and p.what == "kprobe_blacklist link")]  # fmt: skip
            if leftovers:
                problems.append("qprobe left patches in the guest: " + ", ".join(leftovers))
        except QprobeError as exc:
            if t.machine.alive:
                problems.append(f"could not reset the VM: {exc}")
        finally:
            self._stop_watching()
        if not t.machine.alive or (t.qemu is not None and not t.qemu.alive()):
            self.vm.gone = f"the {self.vm.image} VM died during {self.item.nodeid}"
            if not self.gone_said:
                problems.append(self.vm.gone)
        oopses = self.new_oopses()
        if oopses:
            problems.append("the guest kernel reported:\n  " + "\n  ".join(oopses))
        return problems

    # -- reports ----------------------------------------------------------------------------
    def sections(self) -> list[tuple[str, str]]:
        """Report sections for a failure: each read on its own, so that a dead VM still shows its console."""
        t, image = self.target, self.vm.image
        out: list[tuple[str, str]] = []

        def add(title: str, read: Callable[[], str], quiet: bool = False) -> None:
            try:
                text = read()
            except Exception as exc:  # the report must never be lost to a broken VM
                text = "" if quiet else f"(could not be read: {exc})"
            if text.strip():
                out.append((f"qprobe: {title} ({image})", text.rstrip("\n")))

        console, shell = t.console, t.guest_shell
        if console is not None:
            add(f"guest console, last {CONSOLE_TAIL} lines", lambda: guest_console(console.text, CONSOLE_TAIL))
        if shell is not None and shell.port is not console:
            add(f"guest shell, last {CONSOLE_TAIL} lines", lambda: guest_console(shell.port.text, CONSOLE_TAIL))
        add("kernel oops lines since boot", lambda: "\n".join(t.oopses()))
        add("probes registered", t.list_probes, quiet=True)  # asks the VM: nothing to say if it is gone
        add("handler exceptions", lambda: "\n".join(t.kprobes.handlers.errors[self.handler_errors_seen :]))
        return out


_MARKER = re.compile(r"^@@qp-(?:begin|end)-[0-9a-f]+@@\d*$")


def guest_console(text: str, lines: int) -> str:
    """The last ``lines`` lines the guest printed, without qprobe's own: the begin/end markers framing each
    ``target.run`` command (and the blank line each brings) and the boot's ready marker."""
    from qprobe.vmm.console import READY

    out: list[str] = []
    for line in text.splitlines():
        if _MARKER.match(line.strip()) or line.strip() == READY:
            if out and not out[-1].strip():
                out.pop()  # the marker's own leading newline
            continue
        out.append(line)
    return "\n".join(out[-lines:])


def _text_diff(name: str, before: bytes, now: bytes) -> str:
    offsets = [i for i, (a, b) in enumerate(zip(before, now, strict=True)) if a != b]
    lo = offsets[0] & ~15
    return (f"kernel text of {name} changed at offset(s) {', '.join(hex(o) for o in offsets[:8])}"
            f"{' ...' if len(offsets) > 8 else ''}: {name}+{lo:#x} was {before[lo : lo + 16].hex(' ')}, "
            f"is {now[lo : lo + 16].hex(' ')}")  # fmt: skip


_RESET = pytest.StashKey["QprobeReset"]()  # the running test's, which the report hooks read


@pytest.fixture(autouse=True)
def qprobe_reset(request: pytest.FixtureRequest) -> Iterator[QprobeReset | None]:
    """Around every test that uses ``qprobe_target``: probes removed, text and console checked."""
    if "qprobe_target" not in request.fixturenames:
        yield None
        return
    target = request.getfixturevalue("qprobe_target")
    vm = _vm_of(request.config, target, request.getfixturevalue("qprobe_image"))
    if vm.kept is not None:
        request.node.stash[_OUR_SKIP] = True
        pytest.skip(f"the {vm.image} VM of this module was left running after {vm.kept} failed (--qprobe-keep)")
    if vm.gone is not None:
        pytest.fail(f"{vm.gone}; later tests of this module cannot run", pytrace=False)
    item = request.node
    reset = QprobeReset(vm, item)
    item.stash[_RESET] = reset
    reset.start()
    try:
        yield reset
    finally:
        problems = reset.finish()
        reports = item.stash.get(_REPORTS, {})
        failed = bool(problems) or any(r.failed for r in reports.values())
        if failed and request.config.getoption("qprobe_keep", default=False):
            _keep(request.config, vm, item, reports.get("call") or reports.get("setup"))
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


def _keep(config: pytest.Config, vm: _Vm, item: pytest.Item, report: pytest.TestReport | None) -> None:
    """Leave the VM running for inspection: no probes, gdbstub and console released."""
    target = vm.target
    qemu = target.qemu
    if vm.kept is not None or qemu is None or not qemu.alive():
        return
    target.qemu = None  # so that close() detaches and leaves QEMU alone
    try:
        target.close()  # every probe removed, the stub detached (the VM runs on), the console released
    except BaseException:
        qemu.terminate()  # a VM whose probes may still be armed is no use to anyone
        raise
    qemu.keep()
    vm.kept = item.nodeid
    text = "\n".join([
        f"qprobe: the {vm.image} VM was left running after {item.nodeid} failed",
        f"  attach with:  qprobe attach unix:{qemu.gdb_path}",
        f"  (Python:      qprobe.attach('unix:{qemu.gdb_path}'))",
        f"  console log:  {qemu.console_log}",
        f"  shell log:    {qemu.shell_log}",
        f"  stop it with: kill {qemu.proc.pid}; rm -rf {qemu.rundir} {qemu.shmdir}",
    ])  # fmt: skip
    config.stash[_KEPT].append(text)
    if report is not None:
        report.sections.append(("qprobe: VM kept for inspection", text))
    capman = config.pluginmanager.getplugin("capturemanager")
    reporter = config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None:
        if capman is not None:
            with capman.global_and_fixture_disabled():
                reporter.write_line("\n" + text)
        else:
            reporter.write_line("\n" + text)
