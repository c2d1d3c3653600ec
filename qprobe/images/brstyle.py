"""A buildroot-style root filesystem: what a buildroot user boots, for qprobe's own tests.

``rootfs = "buildroot-ext2"`` or ``"buildroot-cpio"`` in kernels/images.toml:
the tree of scripts/guest/buildroot/ (buildroot's skeleton, BusyBox init's
inittab with a getty on the console, rcS and its S01syslogd, S02klogd and
S40network, root without a password) with the host's static busybox
installed as buildroot installs BusyBox (``/bin/busybox`` and a relative
link per applet) and the workload program as the user's own
(``/usr/bin/workload``), as buildroot's ``rootfs.ext2`` or ``rootfs.cpio``
(the latter with buildroot's ``/init``, which mounts devtmpfs and runs
``/sbin/init``, and ``/dev/console``).  Nothing of qprobe's init is in it:
qprobe reaches it through its pre-init (qprobe.images.preinit), as it
reaches a user's buildroot image.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from qprobe.errors import ImageError
from qprobe.images import cache
from qprobe.images.cpio import CpioWriter
from qprobe.images.guest import guest_sources, guest_tree, make_ext2
from qprobe.images.progress import Reporter

__all__ = ["FORMS", "build_rootfs", "skeleton_dir"]

FORMS = {"buildroot-ext2": "rootfs.ext2", "buildroot-cpio": "rootfs.cpio"}
# Buildroot's skeleton: directories, and the symbolic links its var/ and etc/ hold.
_DIRS = ("bin", "sbin", "lib", "usr/bin", "usr/sbin", "usr/lib", "dev/pts", "dev/shm", "proc", "sys", "tmp",
         "run/lock", "root", "mnt", "opt", "media", "var/cache", "var/lib/misc", "var/spool", "home")  # fmt: skip
_LINKS = {"var/log": "../tmp", "var/run": "../run", "var/lock": "../tmp", "var/tmp": "../tmp",
          "etc/mtab": "../proc/self/mounts", "dev/log": "../tmp/log"}  # fmt: skip


def skeleton_dir() -> Path:
    """scripts/guest/buildroot of this checkout (beside the guest's other sources)."""
    return guest_sources().init.with_name("buildroot")


def _inputs() -> list[tuple[str, bytes]]:
    skeleton = skeleton_dir()
    if not (skeleton / "etc" / "inittab").is_file():
        raise ImageError(f"the buildroot-style skeleton {skeleton} is incomplete (no etc/inittab)")
    items = [(str(p.relative_to(skeleton)), p.read_bytes()) for p in sorted(skeleton.rglob("*")) if p.is_file()]
    items.append(("layout", repr((_DIRS, sorted(_LINKS.items()))).encode()))
    items.append(("busybox", guest_sources().busybox.read_bytes()))
    return items


def _build_tree(tree: Path, workload: Path) -> None:
    skeleton = skeleton_dir()
    for d in _DIRS:
        (tree / d).mkdir(parents=True, exist_ok=True)
    (tree / "tmp").chmod(0o1777)
    (tree / "root").chmod(0o700)
    shutil.copytree(skeleton / "etc", tree / "etc", dirs_exist_ok=True)
    (tree / "etc" / "shadow").chmod(0o600)
    for link, target in _LINKS.items():
        (tree / link).symlink_to(target)
    busybox = tree / "bin" / "busybox"
    shutil.copyfile(guest_sources().busybox, busybox)
    busybox.chmod(0o755)
    listing = subprocess.run([str(busybox), "--list-full"], capture_output=True, text=True, check=False)
    if listing.returncode != 0:
        raise ImageError(f"{guest_sources().busybox} --list-full failed: is it a busybox binary?")
    for applet in listing.stdout.split():
        path = tree / applet
        if not path.exists() and not path.is_symlink():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.symlink_to(os.path.relpath(busybox, path.parent))
    shutil.copyfile(workload, tree / "usr" / "bin" / "workload")
    (tree / "usr" / "bin" / "workload").chmod(0o755)


def build_rootfs(form: str, reporter: Reporter) -> Path:
    """The buildroot-style ``rootfs.ext2`` or ``rootfs.cpio`` (``form`` a key of FORMS), built once into the cache."""
    if form not in FORMS:
        raise ImageError(f"unknown buildroot-style root filesystem {form!r}: {', '.join(FORMS)}")
    workload = guest_tree(reporter) / "bin" / "workload"
    key = cache.hash_inputs([*_inputs(), ("workload", workload.read_bytes())])
    root = cache.subdir("buildroot-style")
    directory = root / key
    dest = directory / FORMS[form]
    if dest.is_file():
        cache.touch(directory)
        return dest
    with cache.locked(root, key):
        directory.mkdir(mode=0o755, exist_ok=True)
        cache.remove_leftovers(directory)
        if not (directory / "tree").is_dir():
            with cache.atomic_dir(directory / "tree") as tree:
                tree.chmod(0o755)
                _build_tree(tree, workload)
        if not dest.is_file():
            reporter.note(f"building the buildroot-style {dest.name}")
            if form == "buildroot-ext2":
                make_ext2(directory / "tree", dest, "rootfs")
            else:
                writer = CpioWriter()
                writer.add_tree(directory / "tree")
                writer.add_file("/init", (skeleton_dir() / "init-cpio").read_bytes(), 0o755)
                writer.add_chardev("/dev/console", 5, 1, 0o600)
                with cache.atomic_file(dest) as tmp:
                    tmp.write_bytes(writer.finish())
    cache.prune(root, "[0-9a-f]*", keep=4, protect=[directory], min_age=24 * 3600)
    return dest
