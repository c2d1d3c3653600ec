"""Every images test gets its own empty cache and no user manifest."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _isolated_images(tmp_path, monkeypatch):
    cache = tmp_path / "qprobe-cache"
    monkeypatch.setenv("QPROBE_CACHE", str(cache))
    monkeypatch.setenv("QPROBE_IMAGES", str(tmp_path / "no-user-images.toml"))
    monkeypatch.delenv("QPROBE_MANIFEST", raising=False)
    monkeypatch.delenv("QPROBE_GUEST_SRC", raising=False)
    monkeypatch.delenv("QPROBE_BUSYBOX", raising=False)
    return cache
