#!/usr/bin/env python3
"""Lay out a qprobe image as buildroot's ``output/images/`` and define it as a user image.

    scripts/buildroot-layout.py OUT_DIR [IMAGE]     (IMAGE defaults to debian-cloud-disk)

writes OUT_DIR/bzImage, OUT_DIR/vmlinux, OUT_DIR/rootfs.ext2 (symbolic links
into qprobe's cache; System.map and .config beside them when the image has
them) and OUT_DIR/images.toml defining the image ``buildroot`` from those
files, exactly as a user would for their own buildroot tree.  Then:

    QPROBE_IMAGES=OUT_DIR/images.toml qprobe trace --image buildroot ...
    QPROBE_IMAGES=OUT_DIR/images.toml pytest --qprobe-image buildroot examples/
"""

from __future__ import annotations

import sys
from pathlib import Path

from qprobe.images import get_image


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    out = Path(argv[1]).resolve()
    img = get_image(argv[2] if len(argv) == 3 else "debian-cloud-disk")
    if img.disk is None:
        print(f"buildroot-layout: {img.name} has no disk image (it boots an initramfs)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    files = {"bzImage": img.kernel, "vmlinux": img.vmlinux, "rootfs.ext2": img.disk,
             "System.map": img.system_map, ".config": img.config}  # fmt: skip
    for name, src in files.items():
        if src is None:
            continue
        link = out / name
        link.unlink(missing_ok=True)
        link.symlink_to(Path(src).resolve())
    extra = "".join(f'{key} = "{name}"\n' for key, name in (("system_map", "System.map"), ("config", ".config"))
                    if files[name] is not None)  # fmt: skip
    (out / "images.toml").write_text(
        "[images.buildroot]\n"
        f'description = "{img.name} laid out as buildroot\'s output/images/"\n'
        'kernel = "bzImage"\nvmlinux = "vmlinux"\ndisk = "rootfs.ext2"\n'
        + extra
        # root= is derived; this root filesystem is qprobe's, whose /init prints QPROBE-READY and runs a shell.
        + 'cmdline = "init=/init"\n'
    )
    print(out / "images.toml")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
