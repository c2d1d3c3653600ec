"""module_file on a cached kernel's modules tree: plain and compressed ``.ko`` files."""

from __future__ import annotations

import json
import lzma
from pathlib import Path
from types import SimpleNamespace

import pytest

from qprobe.errors import ImageError
from qprobe.images.modules import module_file

ELF = b"\x7fELF" + bytes(60)


def _image(tmp_path: Path, files: dict[str, bytes]) -> SimpleNamespace:
    kernel_dir = tmp_path / "kernels" / "6.12.117+deb12-cloud-amd64"
    stamp = {"release": "6.12.117+deb12-cloud-amd64", "version": "6.12.117-1", "packages": ["linux-image-x"]}
    (kernel_dir / "modules").mkdir(parents=True)
    (kernel_dir / "source.json").write_text(json.dumps(stamp))
    for rel, data in files.items():
        path = kernel_dir / "modules" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return SimpleNamespace(name="deb", kernel=kernel_dir / "vmlinuz")


def test_a_plain_module_is_returned_as_it_is(tmp_path: Path) -> None:
    image = _image(tmp_path, {"kernel/fs/binfmt_misc.ko": ELF})
    found = module_file(image, "binfmt-misc")  # type: ignore[arg-type]
    assert found.name == "binfmt_misc.ko" and found.read_bytes() == ELF


def test_an_xz_module_is_decompressed_once(tmp_path: Path) -> None:
    image = _image(tmp_path, {"kernel/fs/binfmt_misc.ko.xz": lzma.compress(ELF)})
    found = module_file(image, "binfmt_misc")  # type: ignore[arg-type]
    assert found.name == "binfmt_misc.ko" and found.read_bytes() == ELF
    assert module_file(image, "binfmt_misc") == found  # type: ignore[arg-type]


def test_a_broken_or_missing_module_is_one_line(tmp_path: Path) -> None:
    image = _image(tmp_path, {"kernel/fs/broken.ko.xz": b"not xz"})
    with pytest.raises(ImageError, match=r"cannot decompress .*broken\.ko\.xz"):
        module_file(image, "broken")  # type: ignore[arg-type]
    with pytest.raises(ImageError, match="has no module nosuch"):
        module_file(image, "nosuch")  # type: ignore[arg-type]
