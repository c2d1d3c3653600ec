"""Reading kernel configs: options and the preemption model."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from images_fakes import fake_config

from qprobe.errors import ImageError
from qprobe.images.image import Image, parse_config, preempt_model


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (["CONFIG_PREEMPT_RT=y", "CONFIG_PREEMPT=y"], "rt"),
        (["CONFIG_PREEMPT=y", "# CONFIG_PREEMPT_VOLUNTARY is not set"], "full"),
        (
            ["CONFIG_PREEMPT_VOLUNTARY=y", "# CONFIG_PREEMPT is not set", "CONFIG_PREEMPT_DYNAMIC=y"],
            "voluntary",
        ),
        (["CONFIG_PREEMPT_NONE=y"], "none"),
        (["CONFIG_SMP=y"], "none"),
    ],
)
def test_preempt_from_config(tmp_path: Path, lines: list[str], expected: str) -> None:
    assert preempt_model(fake_config(tmp_path / "config", *lines)) == expected


def test_preempt_unknown_without_config() -> None:
    assert preempt_model(None) == "unknown"


def test_preempt_dynamic_follows_cmdline(tmp_path: Path) -> None:
    dynamic = fake_config(tmp_path / "c1", "CONFIG_PREEMPT_VOLUNTARY=y", "CONFIG_PREEMPT_DYNAMIC=y")
    assert preempt_model(dynamic, "quiet preempt=full") == "full"
    assert preempt_model(dynamic, "preempt=none") == "none"
    static = fake_config(tmp_path / "c2", "CONFIG_PREEMPT_VOLUNTARY=y")
    assert preempt_model(static, "preempt=full") == "voluntary"


def test_debian_cloud_style_config(tmp_path: Path) -> None:
    # The lines as Debian's cloud-amd64 config has them.
    config = fake_config(
        tmp_path / "config-6.1.0-56-cloud-amd64",
        "CONFIG_PREEMPT_BUILD=y",
        "# CONFIG_PREEMPT_NONE is not set",
        "CONFIG_PREEMPT_VOLUNTARY=y",
        "# CONFIG_PREEMPT is not set",
        "CONFIG_PREEMPT_COUNT=y",
        "CONFIG_PREEMPTION=y",
        "CONFIG_PREEMPT_DYNAMIC=y",
    )
    assert preempt_model(config) == "voluntary"


def test_parse_values_and_gzip(tmp_path: Path) -> None:
    text = 'CONFIG_KPROBES=y\nCONFIG_LOCALVERSION="-qp \\"x\\""\nCONFIG_NR_CPUS=64\n# CONFIG_KGDB is not set\n'
    plain = tmp_path / "config"
    plain.write_text(text)
    packed = tmp_path / "config.gz"
    packed.write_bytes(gzip.compress(text.encode()))
    for path in (plain, packed):
        options = parse_config(path)
        assert options["CONFIG_KPROBES"] == "y"
        assert options["CONFIG_LOCALVERSION"] == '-qp "x"'
        assert options["CONFIG_NR_CPUS"] == "64"
        assert "CONFIG_KGDB" not in options


def test_not_a_config(tmp_path: Path) -> None:
    bogus = tmp_path / "config"
    bogus.write_text("hello world\n")
    with pytest.raises(ImageError, match=r"not a kernel \.config"):
        parse_config(bogus)


def test_image_config_option(tmp_path: Path) -> None:
    config = fake_config(tmp_path / "config", "CONFIG_KPROBES=y", "CONFIG_VIRTIO_BLK=m")
    image = Image(
        name="t",
        kernel=tmp_path / "k",
        vmlinux=tmp_path / "v",
        initrd=None,
        disk=None,
        system_map=None,
        config=config,
        cmdline="",
        disk_interface="nvme",
        preempt="none",
        kernel_version="x",
        arch="x86_64",
    )
    assert image.config_option("KPROBES") == "y"
    assert image.config_option("CONFIG_VIRTIO_BLK") == "m"
    assert image.config_option("CONFIG_NOT_THERE") is None
    no_config = Image(**{**image.__dict__, "config": None})
    assert no_config.config_option("KPROBES") is None
