"""The built-in manifest and the user's: schema, paths, errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from images_fakes import fake_bzimage, fake_vmlinux

from qprobe.errors import ImageError
from qprobe.images import list_images
from qprobe.images.manifest import builtin_manifest_path, load_manifest, load_specs, parse_spec


def test_builtin_manifest_has_the_ten_images() -> None:
    specs = load_manifest(builtin_manifest_path(), required=True)
    assert list(specs) == [
        "debian-cloud",
        "debian-rt",
        "debian-cloud-disk",
        "buildroot-ext2",
        "buildroot-cpio",
        "debian-cloud-6.12",
        "debian-rt-6.12",
        "debian-cloud-arm64",
        "debian-cloud-arm64-6.12",
        "minimal-6.12",
    ]
    assert {specs[name].series for name in ("debian-cloud", "debian-rt", "debian-cloud-disk")} == {"6.1"}
    assert (specs["debian-cloud-6.12"].flavour, specs["debian-cloud-6.12"].series) == ("cloud-amd64", "6.12")
    assert (specs["debian-rt-6.12"].flavour, specs["debian-rt-6.12"].series) == ("rt-amd64", "6.12")
    arm64 = specs["debian-cloud-arm64"], specs["debian-cloud-arm64-6.12"]
    assert [(s.flavour, s.series, s.form) for s in arm64] == [
        ("cloud-arm64", "6.1", "initramfs"),
        ("cloud-arm64", "6.12", "initramfs"),
    ]
    minimal = specs["minimal-6.12"]
    assert (minimal.source, minimal.package) == ("build", "linux-source-6.12")
    assert minimal.fragment is not None and minimal.fragment.is_file()
    cloud, rt, disk = specs["debian-cloud"], specs["debian-rt"], specs["debian-cloud-disk"]
    assert (cloud.source, cloud.flavour, cloud.form, cloud.abi) == (
        "debian",
        "cloud-amd64",
        "initramfs",
        None,
    )
    assert (rt.flavour, rt.form) == ("rt-amd64", "initramfs")
    assert (disk.flavour, disk.form, disk.disk_interface) == ("cloud-amd64", "disk", "nvme")
    assert disk.cmdline is not None and "root=/dev/nvme0n1" in disk.cmdline and "console=" not in disk.cmdline
    assert all(spec.description for spec in specs.values())
    # The buildroot-style roots: booted with their own init (no init=), the disk as the kernel names it.
    br_disk, br_cpio = specs["buildroot-ext2"], specs["buildroot-cpio"]
    assert (br_disk.rootfs, br_disk.form, br_cpio.rootfs, br_cpio.form) == (
        "buildroot-ext2",
        "disk",
        "buildroot-cpio",
        "initramfs",
    )
    assert br_disk.cmdline is not None and "root=/dev/nvme0n1" in br_disk.cmdline and "init=" not in br_disk.cmdline


def test_user_manifest_relative_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    images = tmp_path / "br" / "output" / "images"
    images.mkdir(parents=True)
    manifest = tmp_path / "br" / "qprobe.toml"
    manifest.write_text(
        "[images.buildroot]\n"
        'description = "mine"\n'
        'kernel = "output/images/bzImage"\n'
        'vmlinux = "output/images/vmlinux"\n'
        'disk = "output/images/rootfs.ext2"\n'
        'disk_interface = "virtio"\n'
    )
    monkeypatch.setenv("QPROBE_IMAGES", str(manifest))
    specs = load_specs()
    spec = specs["buildroot"]
    assert spec.source == "files"
    assert spec.files["kernel"] == images / "bzImage"
    assert spec.files["disk"] == images / "rootfs.ext2"
    assert spec.form == "disk"
    assert spec.disk_interface == "virtio"
    assert "debian-cloud" in specs  # built-ins stay


def test_list_images_without_cache_or_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = tmp_path / "images.toml"
    fake_bzimage(tmp_path / "bzImage")
    manifest.write_text('[images.half]\nkernel = "bzImage"\nvmlinux = "vmlinux"\n')
    monkeypatch.setenv("QPROBE_IMAGES", str(manifest))
    infos = {info.name: info for info in list_images()}
    assert infos["debian-cloud"].state == "not fetched"
    assert infos["debian-cloud"].source == "debian:cloud-amd64 (series 6.1)"
    assert (infos["minimal-6.12"].source, infos["minimal-6.12"].state) == ("build:linux-source-6.12", "not fetched")
    assert infos["debian-cloud-disk"].rootfs == "disk"
    arm64 = infos["debian-cloud-arm64-6.12"]
    assert (arm64.source, arm64.state) == ("debian:cloud-arm64 (series 6.12)", "not fetched")
    assert infos["half"].state == "partial"
    assert infos["half"].kernel_version == "6.6.0-qptest"
    fake_vmlinux(tmp_path / "vmlinux")
    assert {i.name: i for i in list_images()}["half"].state == "ready"


def test_list_images_sees_cached_kernel(_isolated_images: Path) -> None:
    release = "6.1.0-99-cloud-amd64"
    kdir = _isolated_images / "kernels" / release
    kdir.mkdir(parents=True)
    for name in ("vmlinuz", "config", "vmlinux", "System.map"):
        (kdir / f"{name}-{release}").write_text("x")
    infos = {info.name: info for info in list_images()}
    assert infos["debian-cloud"].state == "partial"  # no stamp: an interrupted extraction
    (kdir / "source.json").write_text('{"version": "6.1.999-1"}')
    infos = {info.name: info for info in list_images()}
    assert infos["debian-cloud"].state == "ready"
    assert infos["debian-cloud"].kernel_version == release
    assert infos["debian-rt"].state == "not fetched"


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"kernel": "k"}, "'vmlinux' is required"),
        ({"vmlinux": "v"}, "'kernel' is required"),
        ({"kernel": "k", "vmlinux": "v", "vmlinx": "v"}, "unknown key"),
        ({"kernel": "k", "vmlinux": "v", "initrd": "i", "disk": "d"}, "either 'initrd' or 'disk'"),
        ({"kernel": "k", "vmlinux": "v", "disk_interface": "ide"}, "disk_interface"),
        ({"kernel": "k", "vmlinux": "v", "rootfs": "nfs"}, "rootfs"),
        ({"kernel": 3, "vmlinux": "v"}, "must be a string"),
        ({"flavour": "cloud-amd64", "kernel": "k"}, "unknown key"),
        ({"source": "debian"}, "needs 'flavour'"),
        ({"source": "http"}, "source must be"),
        ({"flavour": "cloud amd64"}, "not a Debian kernel flavour"),
        ({"flavour": "cloud-amd64", "abi": "latest"}, "abi"),
    ],
)
def test_bad_tables(table: dict[str, object], message: str) -> None:
    with pytest.raises(ImageError, match=message):
        parse_spec("x", table, Path("/tmp/m.toml"))


def test_bad_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("[images.x\n")
    with pytest.raises(ImageError, match="not valid TOML"):
        load_manifest(broken, required=False)
    assert load_manifest(tmp_path / "absent.toml", required=False) == {}
    with pytest.raises(ImageError, match="not found"):
        load_manifest(tmp_path / "absent.toml", required=True)
    stray = tmp_path / "stray.toml"
    stray.write_text('[image.x]\nkernel = "k"\n')
    with pytest.raises(ImageError, match="unknown top-level"):
        load_manifest(stray, required=False)
    clash = tmp_path / "clash.toml"
    clash.write_text('[images.debian-cloud]\nkernel = "k"\nvmlinux = "v"\n')
    monkeypatch.setenv("QPROBE_IMAGES", str(clash))
    with pytest.raises(ImageError, match="clashes with a built-in"):
        load_specs()


def test_debian_abi_pin() -> None:
    spec = parse_spec("pinned", {"flavour": "cloud-amd64", "abi": "6.1.0-56"}, None)
    assert (spec.source, spec.flavour, spec.abi) == ("debian", "cloud-amd64", "6.1.0-56")
    spec = parse_spec("new", {"flavour": "cloud-amd64", "abi": "6.12.117+deb12", "series": "6.12"}, None)
    assert (spec.abi, spec.series) == ("6.12.117+deb12", "6.12")
    with pytest.raises(ImageError, match="not of series"):
        parse_spec("mixed", {"flavour": "cloud-amd64", "abi": "6.12.117+deb12", "series": "6.1"}, None)


def test_build_image_spec(tmp_path: Path) -> None:
    origin = tmp_path / "images.toml"
    spec = parse_spec("small", {"source": "build", "package": "linux-source-6.12", "fragment": "f.config"}, origin)
    assert (spec.source, spec.package, spec.fragment) == ("build", "linux-source-6.12", tmp_path / "f.config")
    for table, needle in (
        ({"source": "build", "fragment": "f"}, "package"),
        ({"source": "build", "package": "linux-6.12", "fragment": "f"}, "package"),
        ({"source": "build", "package": "linux-source-6.12"}, "fragment"),
        ({"source": "build", "package": "linux-source-6.12", "fragment": "f", "kernel": "k"}, "unknown key"),
    ):
        with pytest.raises(ImageError, match=needle):
            parse_spec("bad", table, origin)


def test_an_unknown_user_in_a_path_is_an_image_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = tmp_path / "images.toml"
    manifest.write_text('[images.mine]\nkernel = "~nosuchuser/bzImage"\nvmlinux = "v"\n')
    with pytest.raises(ImageError, match=r"kernel: '~nosuchuser/bzImage' names a user .* that does not exist") as e:
        load_manifest(manifest, required=False)
    assert "\n" not in str(e.value)
    monkeypatch.setenv("QPROBE_IMAGES", "~nosuchuser/images.toml")
    with pytest.raises(ImageError, match="QPROBE_IMAGES"):
        load_specs()


def test_a_malformed_manifest_under_the_pytest_plugin_is_one_line(tmp_path: Path) -> None:
    broken = tmp_path / "images.toml"
    broken.write_text("[images.x\n")
    (tmp_path / "test_x.py").write_text("def test_x(qprobe_target):\n    pass\n")
    env = dict(os.environ, QPROBE_IMAGES=str(broken))
    for argv in (["--qprobe-image", "x"], []):  # the image check at start-up, and the boot in the fixture
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_x.py", *argv],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
        text = out.stdout + out.stderr
        assert out.returncode != 0 and "INTERNALERROR" not in text and "Traceback" not in text, text
        assert f"image manifest {broken} is not valid TOML" in text, text


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b'[images.x]\nkernel = "\xff\xfe"\n', "is not UTF-8 (byte 21): TOML files are UTF-8"),
        (b"a = " + b"[" * 10_000 + b"]" * 10_000 + b"\n", "nests arrays or tables too deep to read"),
    ],
    ids=["not-utf8", "deep"],
)
def test_a_manifest_tomllib_cannot_read_is_one_line(tmp_path: Path, content: bytes, said: str) -> None:
    path = tmp_path / "images.toml"
    path.write_bytes(content)
    with pytest.raises(ImageError) as info:
        load_manifest(path, required=False)
    assert str(info.value) == f"image manifest {path} {said}"
