"""The plugin's command-line options and markers, the images tests run on, and the tests' parametrization."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

import pytest

from qprobe.plugin.state import _IMAGES, _KEPT, _LACKS, _SYMBOLS, _VMS

if TYPE_CHECKING:
    from qprobe.pytest_lacks import Lacks

DEFAULT_IMAGE = "debian-cloud"
Scope = Literal["function", "class", "module", "package", "session"]


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
    _end_session_on_signals()
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


def _end_session_on_signals() -> None:
    """SIGTERM and SIGHUP end the session as Ctrl-C does, its VMs stopped at teardown.

    The API's own handler (``qprobe.lifetime.unwind_on_signal``) raises SystemExit, which pytest takes as the
    failure of the test it lands in, and goes on with the next one.  A handler already set is kept.
    """
    from qprobe.lifetime import UNWIND_SIGNALS

    if threading.current_thread() is not threading.main_thread():
        return  # (a session run from another thread: signals are the main thread's)
    for signum in UNWIND_SIGNALS:
        if signal.getsignal(signum) in (signal.SIG_DFL, None):
            signal.signal(signum, _interrupt)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"qprobe: {signal.Signals(signum).name}")


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
