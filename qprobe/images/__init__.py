"""Kernel images qprobe boots: Debian kernels fetched with apt, or the user's own files.

The usual entry points::

    from qprobe.images import get_image, list_images
    image = get_image("debian-cloud")      # fetches and builds what is missing
    image.kernel, image.vmlinux, image.initrd, image.cmdline
    image.arch                             # "x86_64" or "aarch64": the guest's, from its vmlinux

See ``kernels/images.toml`` for the built-in images and the manifest schema
users follow in ``$QPROBE_IMAGES`` or ``~/.config/qprobe/images.toml``.
"""

from __future__ import annotations

from qprobe.images.cache import cache_dir
from qprobe.images.cpio import CpioWriter, extra_files_cpio
from qprobe.images.image import Image, ImageInfo
from qprobe.images.manifest import DEFAULT_IMAGE
from qprobe.images.modules import module_file
from qprobe.images.registry import (
    disk_with_files,
    get_image,
    image_from_files,
    initrd_with_files,
    list_images,
    with_files,
)

__all__ = [
    "DEFAULT_IMAGE",
    "CpioWriter",
    "Image",
    "ImageInfo",
    "cache_dir",
    "disk_with_files",
    "extra_files_cpio",
    "get_image",
    "image_from_files",
    "initrd_with_files",
    "list_images",
    "module_file",
    "with_files",
]
