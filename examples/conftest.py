"""Nothing to copy from here: with qprobe installed (``pip install qprobe``), its
pytest plugin is loaded by its entry point and the examples need no conftest.py.

This one only makes the examples run from a qprobe source checkout that is
not pip-installed.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    from qprobe.pytest_plugin import register_if_missing

    register_if_missing(pluginmanager)
