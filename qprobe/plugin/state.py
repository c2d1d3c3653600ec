"""What the plugin's parts keep on pytest's config and items (their stash), and the record of each VM."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from qprobe.api import Target
    from qprobe.events import TraceEvent
    from qprobe.images import Image
    from qprobe.kernel.symbols import Symbols
    from qprobe.pytest_lacks import Lacks

_VMS = pytest.StashKey[dict[int, "_Vm"]]()
_IMAGES = pytest.StashKey[dict[str, "Image"]]()
_SYMBOLS = pytest.StashKey[dict[str, "Symbols"]]()
_KEPT = pytest.StashKey[list[str]]()
_REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()
_OUR_SKIP = pytest.StashKey[bool]()
_SKIPPED_ON = pytest.StashKey[str]()  # the image a qprobe_needs_* marker skipped an unparametrized test for
_LACKS: pytest.StashKey[Lacks | None] = pytest.StashKey()


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


def _vm_of(config: pytest.Config, target: Target, image: str) -> _Vm:
    vms = config.stash[_VMS]
    if id(target) not in vms:  # a qprobe_target fixture overridden by the user
        vms[id(target)] = _Vm(image, target)
    return vms[id(target)]
