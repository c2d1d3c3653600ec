"""The fixtures that boot a VM (one per ``--qprobe-scope`` and image) and say what it was booted with."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from qprobe.plugin.options import qprobe_scope, selected_images
from qprobe.plugin.state import _VMS, _Vm, _vm_of

if TYPE_CHECKING:
    from qprobe.api import Target
    from qprobe.core.anywhere import StubPoint
    from qprobe.core.kprobe import Kprobe
    from qprobe.core.point import ProbePoint
    from qprobe.events import TraceEvent


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
