"""Debian kernels of another architecture without the network: a private apt state, the .deb names."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from qprobe.images import apt, debian
from qprobe.images.apt import AptState

ARM64_OPTIONS = [
    "-o", "APT::Architecture=arm64",
    "-o", "APT::Architectures::=arm64",
    "-o", "Dir::State::Lists=/c/apt-arm64/lists",
    "-o", "Dir::Cache=/c/apt-arm64/cache",
    "-o", "Dir::State::status=/dev/null",
]  # fmt: skip


def test_private_apt_state_argv_for_a_foreign_architecture() -> None:
    state = AptState("arm64", Path("/c/apt-arm64"))
    assert state.argv("apt-cache", "depends", "linux-image-cloud-arm64") == [
        "apt-cache", *ARM64_OPTIONS, "depends", "linux-image-cloud-arm64",
    ]  # fmt: skip
    assert state.argv("apt-get", "download", "-q", "p=1") == ["apt-get", *ARM64_OPTIONS, "download", "-q", "p=1"]
    # The host's own apt: the command lines as they always were.
    assert AptState("amd64").argv("apt-cache", "show", "p") == ["apt-cache", "show", "p"]
    assert [apt.flavour_architecture(f) for f in ("cloud-arm64", "rt-amd64", "6.1.0-57-cloud-arm64")] == [
        "arm64", "amd64", "arm64",
    ]  # fmt: skip


def test_apt_state_is_private_only_off_the_host_architecture(
    monkeypatch: pytest.MonkeyPatch, _isolated_images: Path
) -> None:
    monkeypatch.setattr(apt, "host_architecture", lambda: "amd64")
    assert apt.apt_state("amd64") == AptState("amd64")
    assert apt.apt_state("arm64") == AptState("arm64", _isolated_images / "apt-arm64")
    monkeypatch.setattr(apt, "host_architecture", lambda: "arm64")
    assert apt.apt_state("arm64").root is None


def test_private_lists_are_fetched_when_missing_or_a_day_old(
    monkeypatch: pytest.MonkeyPatch, _isolated_images: Path
) -> None:
    ran: list[list[str]] = []

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        ran.append(list(args))
        return subprocess.CompletedProcess(list(args), 0, "", "")

    monkeypatch.setattr(apt, "run", run)
    monkeypatch.setattr(apt, "host_architecture", lambda: "amd64")
    state = apt.apt_state("arm64")
    assert state.root is not None and state.stale() and apt.refresh(state)
    assert ran == [state.argv("apt-get", "-q", "update")]
    assert (state.root / "lists" / "partial").is_dir() and (state.root / "cache" / "archives" / "partial").is_dir()
    assert not state.stale() and not apt.refresh(state) and len(ran) == 1
    assert state.stale(now=time.time() + apt.LISTS_MAX_AGE + 1)
    assert apt.refresh(state, force=True) and len(ran) == 2
    assert not apt.refresh(AptState("amd64")) and len(ran) == 2


def test_resolve_a_foreign_flavour_asks_the_private_state_and_refreshes_once_when_unknown(
    monkeypatch: pytest.MonkeyPatch, _isolated_images: Path
) -> None:
    monkeypatch.setattr(apt, "host_architecture", lambda: "amd64")
    root = _isolated_images / "apt-arm64"
    state = AptState("arm64", root)
    updates: list[bool] = []
    known: dict[tuple[str, ...], str] = {}

    def refresh(s: AptState, *, force: bool = False) -> bool:
        assert s == state
        updates.append(force)
        if force:  # the archive published the kernel since the lists were fetched
            show = ("apt-cache", "show", "--no-all-versions")
            release = "linux-image-6.1.0-57-cloud-arm64"
            depends = "linux-image-cloud-arm64\n  Depends: linux-image-6.1.0-57-cloud-arm64-unsigned\n"
            known[tuple(state.argv("apt-cache", "depends", "linux-image-cloud-arm64"))] = depends
            known[tuple(state.argv(*show, f"{release}-dbg"))] = "Package: d\nVersion: 6.1.192-3\nSize: 262\n"
            known[tuple(state.argv(*show, f"{release}-unsigned"))] = "Package: u\nVersion: 6.1.192-3\nSize: 21\n"
        return False

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        out = known.get(args, "")
        return subprocess.CompletedProcess(list(args), 0 if out else 100, out, "")

    monkeypatch.setattr(debian, "refresh", refresh)
    monkeypatch.setattr(debian, "_apt", run)
    kernel = debian.resolve("cloud-arm64", series="6.1")
    assert updates == [False, True]
    assert (kernel.release, kernel.arch, kernel.image_size) == ("6.1.0-57-cloud-arm64", "arm64", 21)
    assert kernel.image_package == "linux-image-6.1.0-57-cloud-arm64-unsigned"


def test_deb_names_carry_the_architecture() -> None:
    assert debian.deb_name("busybox-static", "1:1.35.0-4+deb12u1+b1", "arm64") == (
        "busybox-static_1%3a1.35.0-4+deb12u1+b1_arm64.deb"
    )
    assert debian.deb_name("linux-image-6.1.0-56-cloud-amd64-dbg", "6.1.192-2", "amd64").endswith("_amd64.deb")
