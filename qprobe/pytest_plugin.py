"""pytest plugin: test a Linux kernel booted under QEMU, with qprobe's probes as the instrument.

Installed with qprobe (entry point ``pytest11: qprobe``), so any test can ask
for a booted kernel::

    from qprobe import Kprobe

    def test_getppid_is_reached(qprobe_target):
        kp = Kprobe(symbol_name="__x64_sys_getppid")
        qprobe_target.register_kprobe(kp)
        qprobe_target.run("workload getppid 10").check()
        assert kp.nhit == 10

Fixtures
    ``qprobe_target``  a booted ``qprobe.Target``: one VM per test module by
                       default (``--qprobe-scope``), once per ``--qprobe-image``.
    ``qprobe_image``   the name of the image the test runs on (the parameter).
    ``qprobe_reset``   autouse for every test that uses ``qprobe_target``: after
                       the test it removes every probe and event still
                       registered, checks that the text of every kernel
                       function qprobe patched during the test is byte-identical
                       to what it was before, and fails the test if the guest
                       printed an oops, BUG, WARNING or panic.  Request it to
                       adjust those checks (``.watch(...)``, ``.strict``).
    ``qprobe_boot_kwargs``  extra ``qprobe.boot()`` arguments (``files=``,
                       ``memory=``, ``cmdline=``, ``tcg_thread=``, ``probes=``):
                       override it in a conftest.py or a test module.  A VM
                       that outlives a module (``--qprobe-scope session``)
                       keeps the arguments of the first test that booted it.
    ``qprobe_boot_events``  the events armed before the kernel's first
                       instruction (``--qprobe-boot-event``, and the definitions
                       among ``qprobe_boot_kwargs``'s ``probes=``), by name
                       (``"ic"``, or ``"GRP/EVENT"``): ``TraceEvent``s whose
                       ``nhit`` counts every hit since ``start_kernel``.

Boot-time probes (``--qprobe-boot-event DEF``, repeatable, or ``probes=`` in
``qprobe_boot_kwargs``: ``Kprobe``, ``Kretprobe`` or kprobe_events definitions)
belong to the VM, not to a test: ``qprobe_reset`` leaves them registered
between tests, so that their counts go on over the VM's life::

    def test_every_initcall_is_seen(qprobe_target, qprobe_boot_events):
        # pytest --qprobe-boot-event 'p:ic do_one_initcall'
        assert qprobe_boot_events["ic"].nhit > 100

Markers
    ``@pytest.mark.qprobe_needs_symbol("name", ...)``  skip on images whose vmlinux lacks a symbol.
    ``@pytest.mark.qprobe_needs_config("CONFIG_X")``   skip on images whose config does not set X;
    ``@pytest.mark.qprobe_needs_config("PREEMPT_RT", "y")``  ... or sets it to another value.

A test whose VM dies (QEMU killed, a panic) ends at once, wherever it waits,
and fails with one line, ``qprobe: error: the VM is gone: ...``; the module's
later tests on that image fail saying so.

A failing test's report carries the tail of the guest console (the kernel's
log), the tail of the guest shell (the commands' output), the oops lines and
the probes that were registered; ``--qprobe-keep`` leaves the VM of a failing
test running (probes removed, gdbstub released) and prints how to ``qprobe
attach`` to it; the module's later tests on that image are skipped.
``--qprobe-no-skip`` makes every skip a failure that names its reason and image (for CI
that must run every test on every image); with ``--qprobe-lacks FILE`` a skip
whose reason names a fact FILE lists for the test's image stays a skip (see
``qprobe.pytest_lacks``).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import pytest

if TYPE_CHECKING:
    from qprobe.api import Target
    from qprobe.core.anywhere import StubPoint
    from qprobe.core.kprobe import Kprobe
    from qprobe.core.point import ProbePoint
    from qprobe.events import TraceEvent
    from qprobe.images import Image
    from qprobe.kernel.symbols import Symbols
    from qprobe.pytest_lacks import Lacks

__all__ = ["QprobeReset", "qprobe_boot_events", "qprobe_boot_kwargs", "qprobe_image", "qprobe_reset", "qprobe_scope",
           "qprobe_target", "register_if_missing", "selected_images"]  # fmt: skip

DEFAULT_IMAGE = "debian-cloud"
CONSOLE_TAIL = 40
Scope = Literal["function", "class", "module", "package", "session"]

_VMS = pytest.StashKey[dict[int, "_Vm"]]()
_IMAGES = pytest.StashKey[dict[str, "Image"]]()
_SYMBOLS = pytest.StashKey[dict[str, "Symbols"]]()
_KEPT = pytest.StashKey[list[str]]()
_RESET = pytest.StashKey["QprobeReset"]()
_REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()
_OUR_SKIP = pytest.StashKey[bool]()
_SKIPPED_ON = pytest.StashKey[str]()  # the image a qprobe_needs_* marker skipped an unparametrized test for
_LACKS = pytest.StashKey["Lacks | None"]()


# -- options, markers, parametrization ---------------------------------------------------
def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("qprobe", "qprobe: test a kernel booted under QEMU")
    group.addoption("--qprobe-image", action="append", dest="qprobe_images", metavar="NAME", default=None,
                    help="image to boot for tests that use qprobe_target (repeatable: the tests run once per "
                         f"image; default: $QPROBE_TEST_IMAGE or {DEFAULT_IMAGE})")  # fmt: skip
    group.addoption("--qprobe-smp", type=int, default=2, metavar="N", help="vCPUs of each VM (default 2)")
    group.addoption("--qprobe-memory", default="512M", metavar="SIZE", help="guest RAM of each VM (default 512M)")
    group.addoption("--qprobe-boot-timeout", type=float, default=180.0, metavar="S",
                    help="seconds a VM may take to boot (default 180: TCG on a busy machine is slow)")  # fmt: skip
    group.addoption("--qprobe-boot-event", action="append", dest="qprobe_boot_events", metavar="DEF", default=[],
                    help="a kprobe_events definition armed in every VM before the kernel's first instruction "
                         "(repeatable; the qprobe_boot_events fixture holds its events)")  # fmt: skip
    group.addoption("--qprobe-scope", choices=get_args(Scope), default="module",
                    help="how long one VM lives: one per test module by default")  # fmt: skip
    group.addoption("--qprobe-keep", action="store_true", default=False,
                    help="leave a failing test's VM running (probes removed); print how to attach to it")  # fmt: skip
    group.addoption("--qprobe-no-skip", action="store_true", default=False,
                    help="a skipped test fails, with its reason (CI that must run everything: an image "
                         "without a symbol or config a test needs is then an error)")  # fmt: skip
    group.addoption("--qprobe-lacks", dest="qprobe_lacks", metavar="FILE", default=None,
                    help="with --qprobe-no-skip: a TOML list of the facts each image lacks, with the reason; a "
                         "skip whose reason names one listed for the test's image stays a skip")  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "qprobe: the test boots a kernel under QEMU (it uses qprobe_target)")
    config.addinivalue_line(
        "markers", "qprobe_needs_symbol(*names): skip on images whose vmlinux lacks one of these symbols"
    )
    config.addinivalue_line(
        "markers",
        "qprobe_needs_config(option, value=None): skip on images whose kernel config does not set option "
        "(CONFIG_ prefix optional), or sets it to something other than value",
    )
    config.stash[_VMS] = {}
    config.stash[_IMAGES] = {}
    config.stash[_SYMBOLS] = {}
    config.stash[_KEPT] = []
    config.stash[_LACKS] = _load_lacks(config)
    if config.getoption("qprobe_images"):
        from qprobe.errors import QprobeError
        from qprobe.images import list_images

        try:
            known = [info.name for info in list_images()]
        except QprobeError as exc:  # a malformed images.toml: one line, not an INTERNALERROR traceback
            raise pytest.UsageError(f"qprobe: {exc}") from None
        unknown = [name for name in selected_images(config) if name not in known]
        if unknown:
            raise pytest.UsageError(f"--qprobe-image: unknown image(s) {', '.join(unknown)}; "
                                    f"known: {', '.join(known)} (see `qprobe images`)")  # fmt: skip


def _load_lacks(config: pytest.Config) -> Lacks | None:
    given = config.getoption("qprobe_lacks", default=None)
    if not given:
        return None
    from qprobe.errors import QprobeError
    from qprobe.images.manifest import load_specs
    from qprobe.pytest_lacks import Lacks, LacksError

    try:
        return Lacks.load(Path(given), load_specs())
    except (LacksError, QprobeError) as exc:
        raise pytest.UsageError(f"--qprobe-lacks: {exc}") from None


def selected_images(config: pytest.Config) -> list[str]:
    """The images tests run on: ``--qprobe-image`` values, else ``$QPROBE_TEST_IMAGE``, else debian-cloud."""
    given = config.getoption("qprobe_images", default=None) or [os.environ.get("QPROBE_TEST_IMAGE") or DEFAULT_IMAGE]
    return list(dict.fromkeys(given))


def qprobe_scope(fixture_name: str, config: pytest.Config) -> Scope:
    """The scope of the VM fixtures (``--qprobe-scope``); use it for fixtures that depend on ``qprobe_target``."""
    return config.getoption("qprobe_scope", default="module") or "module"  # a Scope: the option's choices


def pytest_report_header(config: pytest.Config) -> str:
    return (f"qprobe: images {', '.join(selected_images(config))}; smp {config.getoption('qprobe_smp')}; "
            f"one VM per {qprobe_scope('', config)}")  # fmt: skip


def _parametrized_explicitly(metafunc: pytest.Metafunc, name: str) -> bool:
    for marker in metafunc.definition.iter_markers("parametrize"):
        names = marker.args[0] if marker.args else marker.kwargs.get("argnames", ())
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if name in names:
            return True
    return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Every test that (through any fixture) uses qprobe_target runs once per image;
    # the image is a parameter of the VM's scope, so each VM boots once.
    if "qprobe_image" in metafunc.fixturenames and not _parametrized_explicitly(metafunc, "qprobe_image"):
        images = selected_images(metafunc.config)
        metafunc.parametrize("qprobe_image", images, ids=images, indirect=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "qprobe_target" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.qprobe)


# -- images, symbols and the markers that skip ----------------------------------------------
def _image(config: pytest.Config, name: str) -> Image:
    cache = config.stash[_IMAGES]
    if name not in cache:
        from qprobe.images import get_image

        cache[name] = get_image(name)  # fetched and built on first use, as boot() would
    return cache[name]


def _symbols(config: pytest.Config, name: str) -> Symbols:
    cache = config.stash[_SYMBOLS]
    if name not in cache:
        for vm in config.stash[_VMS].values():
            if vm.image == name:
                cache[name] = vm.target.symbols
                break
        else:
            from qprobe.kernel.symbols import Symbols

            cache[name] = Symbols.load(_image(config, name).vmlinux)  # cached by build-id: fast
    return cache[name]


def _unmet(config: pytest.Config, image: str, item: pytest.Item) -> str | None:
    """Why ``item`` cannot run on ``image`` (a skip reason naming the image), or None."""
    for marker in item.iter_markers("qprobe_needs_symbol"):
        if not marker.args:
            raise pytest.UsageError(f"{item.nodeid}: qprobe_needs_symbol needs at least one symbol name")
        syms = _symbols(config, image)
        for name in marker.args:
            if name not in syms:
                return f"image {image}: its vmlinux has no symbol {name!r}"
    for marker in item.iter_markers("qprobe_needs_config"):
        if not 1 <= len(marker.args) <= 2:
            raise pytest.UsageError(f"{item.nodeid}: use qprobe_needs_config(option) or (option, value)")
        option = str(marker.args[0])
        option = option if option.startswith("CONFIG_") else f"CONFIG_{option}"
        want = marker.args[1] if len(marker.args) == 2 else None
        img = _image(config, image)
        if img.config is None:
            return f"image {image}: no kernel config to check {option} in"
        have = img.config_option(option)
        if want is None and have is None:
            return f"image {image}: {option} is not set"
        if want is not None and have != str(want):
            return f"image {image}: {option} is {have if have is not None else 'not set'}, the test needs {want}"
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Before any fixture: a test that cannot run on this image must not boot it.
    if not any(item.iter_markers("qprobe_needs_symbol")) and not any(item.iter_markers("qprobe_needs_config")):
        return
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "qprobe_image" in callspec.params:
        images = [callspec.params["qprobe_image"]]
    else:
        images = selected_images(item.config)
    for image in images:
        reason = _unmet(item.config, image, item)
        if reason is not None:
            item.stash[_OUR_SKIP] = True  # reported at the test, not here
            item.stash[_SKIPPED_ON] = image
            pytest.skip(reason)


# -- the VM ------------------------------------------------------------------------------
@dataclass(eq=False)
class _Vm:
    image: str
    target: Target
    kept: str | None = None  # the test whose failure kept this VM running
    gone: str | None = None  # why the VM cannot be used any more
    boot_events: dict[str, TraceEvent] = field(default_factory=dict)  # armed before the kernel ran, by name
    boot_probes: tuple[object, ...] = ()  # the probes armed then: the VM's, kept between tests

    def at_boot(self, probe: object) -> bool:
        return any(probe is p for p in self.boot_probes)

    def follows_modules(self) -> bool:
        """Some boot-time event is on a module's function: the module notifier is the VM's too."""
        return any(ev.symbol is not None and ":" in ev.symbol
                   for te in self.boot_events.values() for ev in (p.definition for p in te.probes()))  # fmt: skip


@pytest.fixture(scope=qprobe_scope)
def qprobe_image(request: pytest.FixtureRequest) -> str:
    """The name of the image this test runs on (one parameter per ``--qprobe-image``)."""
    return str(getattr(request, "param", None) or selected_images(request.config)[0])


@pytest.fixture(scope=qprobe_scope)
def qprobe_boot_kwargs() -> dict[str, Any]:
    """Extra keyword arguments for ``qprobe.boot()``; override in a conftest.py or a test module, e.g.
    ``{"files": {"/bin/mytest": "build/mytest"}}`` to add a program to the guest, or
    ``{"tcg_thread": "single"}`` to run every vCPU on one TCG thread."""
    return {}


@pytest.fixture(scope=qprobe_scope)
def qprobe_target(request: pytest.FixtureRequest, qprobe_image: str,
                  qprobe_boot_kwargs: dict[str, Any]) -> Iterator[Target]:  # fmt: skip
    """A booted kernel: one VM per test module (``--qprobe-scope``) and image, reset between tests."""
    import qprobe

    config = request.config
    kwargs: dict[str, Any] = {
        "smp": config.getoption("qprobe_smp", default=2),
        "memory": config.getoption("qprobe_memory", default="512M"),
        "boot_timeout": config.getoption("qprobe_boot_timeout", default=180.0),
        # Only a VM that --qprobe-keep may hand over is spared when pytest dies; the others die with it.
        "keepable": bool(config.getoption("qprobe_keep", default=False)),
        **qprobe_boot_kwargs,
    }
    given = config.getoption("qprobe_boot_events", default=[]) or []
    if given:
        kwargs["probes"] = [*kwargs.get("probes", ()), *given]
    failed = None
    try:
        target = qprobe.boot(qprobe_image, **kwargs)
    except qprobe.QprobeError as exc:  # a bad image, manifest or cache, a guest that will not boot
        notes = "".join(f" ({note})" for note in getattr(exc, "__notes__", []))
        failed = f"qprobe could not boot {qprobe_image}: {exc}{notes}"
    if failed is not None:
        # Outside the except clause: a failure raised there would chain the error's traceback to its one line.
        pytest.fail(failed, pytrace=False)
    vm = _Vm(qprobe_image, target)
    if kwargs.get("probes") or kwargs.get("at_boot"):
        vm.boot_events, vm.boot_probes = _armed_at_boot(target)
    config.stash[_VMS][id(target)] = vm
    try:
        yield target
    finally:
        config.stash[_VMS].pop(id(target), None)
        if vm.kept is None:
            try:
                target.close()
            finally:
                if target.qemu is not None and target.qemu.alive():  # close() failed half way
                    target.qemu.terminate()
        del target, vm
        _give_back_memory()


def _give_back_memory() -> None:
    """Return a closed VM's memory to the system: its symbols and drgn program are hundreds of MB that
    glibc's allocator keeps in its arenas once freed, so the test process would grow module by module."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except AttributeError:  # a C library without it (not glibc)
        pass


def _user_kprobes(target: Target) -> list[Kprobe]:
    """Every kprobe registered, int3 or stub breakpoint, but qprobe's own (return sites, boot milestones)."""
    from qprobe.core.anywhere import InternalProbe

    points: list[ProbePoint | StubPoint] = [*target.kprobes.points.values(), *target.kprobes.stubs.points.values()]
    return [kp for point in points for kp in point.probes if not isinstance(kp, InternalProbe)]


def _armed_at_boot(target: Target) -> tuple[dict[str, TraceEvent], tuple[object, ...]]:
    """What a VM booted with boot-time probes holds once it is up: every event and probe in it was armed
    before the kernel ran (the module notifier's hooks are qprobe's own)."""
    hooks = target.modules.hooks
    kps = [kp for kp in _user_kprobes(target) if not any(kp is h for h in hooks)]
    return dict(target.events), (*kps, *target.kretprobes.registered)


@pytest.fixture(scope=qprobe_scope)
def qprobe_boot_events(request: pytest.FixtureRequest, qprobe_target: Target) -> dict[str, TraceEvent]:
    """The events armed before the kernel's first instruction, by event name and by ``GRP/EVENT``."""
    vm = _vm_of(request.config, qprobe_target, request.getfixturevalue("qprobe_image"))
    out = dict(vm.boot_events)
    for te in vm.boot_events.values():
        out.setdefault(te.definition.event, te)
    return out


# -- between tests ---------------------------------------------------------------------------
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


def _vm_of(config: pytest.Config, target: Target, image: str) -> _Vm:
    vms = config.stash[_VMS]
    if id(target) not in vms:  # a qprobe_target fixture overridden by the user
        vms[id(target)] = _Vm(image, target)
    return vms[id(target)]


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


# -- reports ---------------------------------------------------------------------------------
@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    reset = item.stash.get(_RESET, None)
    gone = None
    try:
        if reset is None:
            result = yield
        else:
            # A VM that dies mid-test ends the test at once, wherever it waits (a sleep, a loop on a count).
            with reset.target.interrupt_when_gone():
                result = yield
    except BaseException as exc:
        if reset is None:
            raise
        reset.new_oopses()  # the failure's report lists them; no second error at teardown
        gone = reset.gone(exc)
        if gone is None:
            raise
    if gone is not None:  # one line, not the traceback of wherever the test happened to be
        pytest.fail(f"qprobe: error: {gone}", pytrace=False)
    # An oops during a test that otherwise passed fails the test itself (not its teardown).
    if reset is not None:
        oopses = reset.new_oopses()
        if oopses:
            pytest.fail("the guest kernel reported:\n  " + "\n  ".join(oopses), pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    item.stash.setdefault(_REPORTS, {})[report.when] = report
    if report.skipped and item.stash.get(_OUR_SKIP, False) and isinstance(report.longrepr, tuple):
        filename, line = item.reportinfo()[:2]
        report.longrepr = (str(filename), (line or 0) + 1, report.longrepr[2])
    if item.config.getoption("qprobe_no_skip", False):
        if report.when == "setup" and item.config.stash.get(_LACKS, None) is not None:
            image = _image_of(item)
            if image is not None:  # the images tests ran on: the list's facts of the others are not asked about
                report.user_properties.append(("qprobe_image", image))
        if report.skipped and not hasattr(report, "wasxfail"):
            _no_skip(item, report)
    reset = item.stash.get(_RESET, None)
    if report.failed and reset is not None:
        report.sections.extend(reset.sections())
    if report.when == "teardown" and reset is not None:
        # pytest keeps every item until the session ends: a reset left in its stash would keep the
        # module's Target, and with it its symbols and drgn program, long after its VM is gone.
        del item.stash[_RESET]
    return report


def _image_of(item: pytest.Item) -> str | None:
    """The image the test ran on: its parameter, else the one a qprobe_needs_* marker skipped it for."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "qprobe_image" in callspec.params:
        return str(callspec.params["qprobe_image"])
    return item.stash.get(_SKIPPED_ON, None)


def _no_skip(item: pytest.Item, report: pytest.TestReport) -> None:
    """Under --qprobe-no-skip: the skip stands if its reason names a fact the image is listed as lacking,
    else it becomes a failure that names its reason and the image."""
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    image, lacks = _image_of(item), item.config.stash.get(_LACKS, None)
    where = unlisted = ""
    if image is not None:
        where = f" on image {image}"
        if lacks is not None:
            fact = lacks.named(image, reason)
            if fact is not None and isinstance(report.longrepr, tuple):
                # On the report, which reaches the terminal summary also from an xdist worker.
                report.user_properties.append(("qprobe_lacked", (image, fact)))
                report.longrepr = (*report.longrepr[:2], f"{reason} ({lacks.path}: {lacks.facts[image][fact]})")
                return
            unlisted = f" (it names no fact {lacks.path} lists for {image})"
    report.outcome = "failed"
    report.longrepr = f"skipped{where}, and --qprobe-no-skip makes a skip a failure: {reason}{unlisted}"


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    # A module skipped as it is collected (a module-level skip, importorskip) is a skip too.
    report = yield
    if report.skipped and collector.config.getoption("qprobe_no_skip", False):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped, and --qprobe-no-skip makes a skip a failure: {reason}"
    return report


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    kept = config.stash.get(_KEPT, [])
    if kept:
        terminalreporter.section("qprobe: VMs left running (--qprobe-keep)")
        for text in kept:
            terminalreporter.write_line(text)
    lacks = config.stash.get(_LACKS, None)
    if lacks is not None and config.getoption("qprobe_no_skip", False):
        # From the reports, which reach this process also from xdist's workers, where the tests ran.
        props = [prop for reports in terminalreporter.stats.values() for report in reports
                 for prop in getattr(report, "user_properties", ())]  # fmt: skip
        ran = {str(value) for name, value in props if name == "qprobe_image"}
        used = {(str(value[0]), str(value[1])) for name, value in props if name == "qprobe_lacked"}
        unused = lacks.unused(sorted(ran), used)
        if unused:
            terminalreporter.write_line(f"qprobe: no skip of this run named these facts {lacks.path} lists: "
                                        + "; ".join(unused), yellow=True)  # fmt: skip


# -- for a source checkout ---------------------------------------------------------------------
def register_if_missing(pluginmanager: pytest.PytestPluginManager) -> None:
    """Register this plugin unless pytest already has it (from the ``pytest11`` entry point or ``-p``).

    For conftest.py files of a qprobe source checkout that is not pip-installed;
    call it from ``pytest_addoption(parser, pluginmanager)`` so that the options
    exist before the command line is parsed::

        def pytest_addoption(parser, pluginmanager):
            from qprobe.pytest_plugin import register_if_missing
            register_if_missing(pluginmanager)
    """
    this = sys.modules[__name__]
    if pluginmanager.is_registered(this) or pluginmanager.has_plugin("qprobe") or pluginmanager.is_blocked("qprobe"):
        return
    pluginmanager.register(this, "qprobe")
