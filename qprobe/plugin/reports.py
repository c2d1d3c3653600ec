"""What a test's report says: the VM's state on a failure, a skip under ``--qprobe-no-skip``; a VM that dies
mid-test ends it; the terminal summary of kept VMs and of the ``--qprobe-lacks`` facts no skip named."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any

import pytest

from qprobe.plugin.reset import _RESET
from qprobe.plugin.state import _KEPT, _LACKS, _OUR_SKIP, _REPORTS, _SKIPPED_ON


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
