"""Built images (source = "build"): cached once per script and fragment, failures leave nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from images_fakes import fake_bzimage, fake_vmlinux

from qprobe.errors import ImageError
from qprobe.images import build, list_images
from qprobe.images.manifest import parse_spec
from qprobe.images.progress import Reporter


def _fake_script(tmp_path: Path, body: str) -> Path:
    """A stand-in for build-minimal-kernel.sh with its interface: PACKAGE FRAGMENT WORKDIR OUTDIR."""
    fake_bzimage(tmp_path / "bz")
    fake_vmlinux(tmp_path / "vml")
    script = tmp_path / "build.sh"
    script.write_text(
        "set -eu\n"
        f'echo "$1 $(head -1 "$2")" >>"{tmp_path}/calls"\n'
        'mkdir -p "$3"\n'
        f"{body}\n"
        f'cp "{tmp_path}/bz" "$4/bzImage"; cp "{tmp_path}/vml" "$4/vmlinux"\n'
        'echo "c System.map" >"$4/System.map"; echo CONFIG_SMP=y >"$4/config"\n'
        'echo \'{"release": "6.12.117", "version": "6.12.117-1", "build_seconds": 1}\' >"$4/build.json"\n'
    )
    return script


def _spec(tmp_path: Path, fragment_text: str = "CONFIG_SMP=y\n"):
    manifest = tmp_path / "images.toml"
    (tmp_path / "small.config").write_text(fragment_text)
    table = {"source": "build", "package": "linux-source-6.12", "fragment": "small.config"}
    return parse_spec("small", table, manifest)


def test_build_once_then_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _isolated_images: Path) -> None:
    monkeypatch.setattr(build, "script_path", lambda: _fake_script(tmp_path, ""))
    spec = _spec(tmp_path)
    assert build.build_state(spec) == ("not fetched", None)
    files = build.build_kernel(spec, Reporter(False))
    again = build.build_kernel(spec, Reporter(False))
    assert files == again and files.release == "6.12.117" and files.vmlinuz.name == "bzImage"
    assert (tmp_path / "calls").read_text() == "linux-source-6.12 CONFIG_SMP=y\n"  # built once
    assert build.build_state(spec) == ("ready", "6.12.117")
    # A changed fragment is a different kernel: built again, the old build pruned.
    spec2 = _spec(tmp_path, "CONFIG_SMP=y\nCONFIG_PRINTK=y\n")
    assert build.build_state(spec2)[0] == "not fetched"
    files2 = build.build_kernel(spec2, Reporter(False))
    assert len((tmp_path / "calls").read_text().splitlines()) == 2
    kept = [p for p in (_isolated_images / "kernels").iterdir() if not p.name.startswith(".")]
    assert kept == [files2.vmlinuz.parent] and files2.vmlinuz.parent != files.vmlinuz.parent


def test_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _isolated_images: Path) -> None:
    monkeypatch.setattr(build, "script_path", lambda: _fake_script(tmp_path, 'echo "objtool: boom" >&2; exit 2'))
    spec = _spec(tmp_path)
    with pytest.raises(ImageError, match="objtool: boom"):
        build.build_kernel(spec, Reporter(False))
    assert build.build_state(spec) == ("not fetched", None)
    assert [p for p in (_isolated_images / "kernels").iterdir() if not p.name.startswith(".lock-")] == []


def test_missing_fragment_is_one_error(tmp_path: Path, _isolated_images: Path) -> None:
    spec = parse_spec(
        "small", {"source": "build", "package": "linux-source-6.12", "fragment": "nope.config"}, tmp_path / "m.toml"
    )
    with pytest.raises(ImageError, match="config fragment of image 'small'"):
        build.build_kernel(spec, Reporter(False))


def test_builtin_minimal_image_is_listed(_isolated_images: Path) -> None:
    info = {i.name: i for i in list_images()}["minimal-6.12"]
    assert (info.source, info.state, info.rootfs) == ("build:linux-source-6.12", "not fetched", "initramfs")
