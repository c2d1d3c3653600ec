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

import sys

import pytest

# pytest finds hooks and fixtures only as attributes of the module it registers (this one), so each is
# imported here under its own name (the "as" marks it as exported, for ruff and mypy).
from qprobe.plugin.markers import pytest_runtest_setup as pytest_runtest_setup
from qprobe.plugin.options import pytest_addoption as pytest_addoption
from qprobe.plugin.options import pytest_collection_modifyitems as pytest_collection_modifyitems
from qprobe.plugin.options import pytest_configure as pytest_configure
from qprobe.plugin.options import pytest_generate_tests as pytest_generate_tests
from qprobe.plugin.options import pytest_report_header as pytest_report_header
from qprobe.plugin.options import qprobe_scope, selected_images
from qprobe.plugin.reports import pytest_make_collect_report as pytest_make_collect_report
from qprobe.plugin.reports import pytest_runtest_call as pytest_runtest_call
from qprobe.plugin.reports import pytest_runtest_makereport as pytest_runtest_makereport
from qprobe.plugin.reports import pytest_terminal_summary as pytest_terminal_summary
from qprobe.plugin.reset import QprobeReset, qprobe_reset
from qprobe.plugin.reset import guest_console as guest_console
from qprobe.plugin.vm import qprobe_boot_events, qprobe_boot_kwargs, qprobe_image, qprobe_target

__all__ = ["QprobeReset", "qprobe_boot_events", "qprobe_boot_kwargs", "qprobe_image", "qprobe_reset", "qprobe_scope",
           "qprobe_target", "register_if_missing", "selected_images"]  # fmt: skip


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
