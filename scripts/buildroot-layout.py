#!/usr/bin/env python3
"""Lay out a qprobe image as a buildroot ``output/`` directory and define it as a user image.

    scripts/buildroot-layout.py [--strip-debug] OUT_DIR [IMAGE]     (IMAGE defaults to debian-cloud-disk)

writes, as buildroot leaves them (symbolic links into qprobe's cache):

    OUT_DIR/output/images/bzImage, rootfs.ext2, start-qemu.sh
    OUT_DIR/output/build/linux-RELEASE/vmlinux, .config, System.map
    OUT_DIR/output/build/linux-headers-RELEASE/          (buildroot's kernel headers: no vmlinux)

start-qemu.sh is what buildroot's board/qemu/post-image.sh writes from start-qemu.sh.in, its QEMU
command line attaching the disk as the kernel's config has a driver built in for (virtio-blk as
buildroot's qemu_x86_64 board does, else NVMe); its -append adds ``rw init=/init``, since this root
filesystem is qprobe's own (its init writes /dev; buildroot's remounts the root read-write itself).
``--strip-debug`` makes vmlinux a copy without DWARF, as a kernel built
without CONFIG_DEBUG_INFO.  OUT_DIR/images.toml defines the image ``buildroot`` by the one key
``buildroot = "output"``.  Then:

    QPROBE_IMAGES=OUT_DIR/images.toml qprobe trace --image buildroot ...
    QPROBE_IMAGES=OUT_DIR/images.toml pytest --qprobe-image buildroot examples/
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from qprobe.images import get_image
from qprobe.images.image import disk_interface_of

# board/qemu/start-qemu.sh.in (buildroot 2025.x) with post-image.sh's substitutions for a serial console.
START_QEMU = """#!/bin/sh

BINARIES_DIR="${{0%/*}}/"
# shellcheck disable=SC2164
cd "${{BINARIES_DIR}}"

mode_serial=false
mode_sys_qemu=false
while [ "$1" ]; do
    case "$1" in
    --serial-only|serial-only) mode_serial=true; shift;;
    --use-system-qemu) mode_sys_qemu=true; shift;;
    --) shift; break;;
    *) echo "unknown option: $1" >&2; exit 1;;
    esac
done

if ${{mode_serial}}; then
    EXTRA_ARGS='-nographic'
else
    EXTRA_ARGS='-serial stdio'
fi

if ! ${{mode_sys_qemu}}; then
    export PATH="{host}/bin:${{PATH}}"
fi

exec qemu-system-x86_64 -M pc -kernel bzImage {drive} -append "rootwait root={root} console=tty1 console=ttyS0 \
rw init=/init"  -net nic,model=virtio -net user  ${{EXTRA_ARGS}} "$@"
"""
DRIVES = {
    "virtio": ("-drive file=rootfs.ext2,if=virtio,format=raw", "/dev/vda"),
    "nvme": ("-drive file=rootfs.ext2,if=none,format=raw,id=hd0 -device nvme,drive=hd0,serial=br0", "/dev/nvme0n1"),
}


def link(path: Path, target: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    path.symlink_to(target.resolve())


def main(argv: list[str]) -> int:
    strip = "--strip-debug" in argv
    args = [a for a in argv[1:] if a != "--strip-debug"]
    if len(args) not in (1, 2):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    out = Path(args[0]).resolve()
    img = get_image(args[1] if len(args) == 2 else "debian-cloud-disk")
    if img.disk is None or img.config is None:
        print(f"buildroot-layout: {img.name} has no disk image or no config", file=sys.stderr)
        return 2
    output = out / "output"
    shutil.rmtree(output, ignore_errors=True)
    images, linux = output / "images", output / "build" / f"linux-{img.kernel_version}"
    link(images / "bzImage", img.kernel)
    link(images / "rootfs.ext2", img.disk)
    link(linux / ".config", img.config)
    if img.system_map is not None:
        link(linux / "System.map", img.system_map)
    if strip:
        subprocess.run(["objcopy", "--strip-debug", str(img.vmlinux), str(linux / "vmlinux")], check=True)
    else:
        link(linux / "vmlinux", img.vmlinux)
    (output / "build" / f"linux-headers-{img.kernel_version}").mkdir()
    drive, root = DRIVES[disk_interface_of(img.config)]
    script = images / "start-qemu.sh"
    script.write_text(START_QEMU.format(host=output / "host", drive=drive, root=root))
    script.chmod(0o755)
    (out / "images.toml").write_text(
        f'[images.buildroot]\ndescription = "{img.name} laid out as buildroot\'s output/"\nbuildroot = "output"\n'
    )
    print(out / "images.toml")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
