"""The guest's root filesystem: busybox, /init, the workload and uprog programs.

Built on the host without root from ``scripts/guest/`` and the host's static
busybox, into ``<cache>/guest/<hash>/``, where the hash covers every input
(workload.c, init, uprog.c, libqpt.c, the busybox binary, the host libraries
copied in, this module's layout version): a change to any of them builds a
new directory, an unchanged checkout reuses the old one.

uprog is built twice: ``/bin/uprog-static`` (``gcc -static``, with libqpt.c
linked in) and ``/bin/uprog``, linked against the host's libc and
``/usr/lib/libqpt.so`` (its RUNPATH). The dynamic program's interpreter and
every library the host's loader resolves for it (``ld.so --list``) are
copied into the tree at the paths the loader gave, which are in its default
search path (the guest has no ld.so.cache). Which libraries those are is
known only once uprog is linked, so the first build for some sources links
it once to find out and remembers the list in ``libs-<hash>``; the
directory's hash then covers each library's path, size and mtime.

One tree gives both forms:

* ``initramfs.cpio.gz``: the tree through our own cpio writer, which also
  adds ``/dev/console`` (char 5:1), the node the kernel opens for init's
  stdin/stdout before ``/init`` runs;
* ``rootfs.ext2``: ``mke2fs -t ext2 -d tree``, for booting from a disk. Its
  ``/dev`` is empty: the console is opened from the kernel's built-in
  initramfs before the disk is mounted, and /init mounts devtmpfs.
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from qprobe.errors import ImageError
from qprobe.images import cache
from qprobe.images.cpio import CpioWriter
from qprobe.images.progress import Reporter

__all__ = [
    "GuestFiles",
    "build_disk",
    "build_initramfs",
    "guest_sources",
    "guest_tree",
    "interpreter",
    "make_ext2",
]

# Bump when the tree's layout changes, so old cached builds are not reused.
LAYOUT_VERSION = "2"
DISK_MIN_BYTES = 32 << 20

_ETC = {
    "etc/passwd": "root:x:0:0:root:/root:/bin/sh\n",
    "etc/group": "root:x:0:\n",
    "etc/hostname": "qprobe\n",
    "etc/shells": "/bin/sh\n",
}
# Empty directories the tree needs, with their modes.
_DIRS = {
    "dev": 0o755,
    "proc": 0o555,
    "sys": 0o555,
    "tmp": 0o1777,
    "run": 0o755,
    "root": 0o700,
    "mnt": 0o755,
    "var": 0o755,
    "etc": 0o755,
    "bin": 0o755,
    "sbin": 0o755,
    "usr": 0o755,
    "usr/bin": 0o755,
    "usr/sbin": 0o755,
    "usr/lib": 0o755,
}
# Where /bin/uprog finds libqpt.so (its RUNPATH).
LIBQPT_DIR = "/usr/lib"
_CFLAGS = ["-O2", "-g", "-Wall", "-pthread"]


@dataclass(frozen=True)
class GuestFiles:
    """Where the guest's inputs are on the host."""

    workload_c: Path
    init: Path
    busybox: Path
    uprog_c: Path
    libqpt_c: Path

    def sources_key(self) -> str:
        """Hash of the inputs in the checkout and busybox (not the host libraries)."""
        items = [("layout", LAYOUT_VERSION.encode())]
        for path in (self.workload_c, self.init, self.uprog_c, self.libqpt_c, self.busybox):
            try:
                items.append((path.name, path.read_bytes()))
            except OSError as exc:
                raise ImageError(f"cannot read guest input {path}: {exc.strerror}") from exc
        return cache.hash_inputs(items)

    def key(self) -> str:
        """Hash of every input: the name of this build's cache directory."""
        items = [("sources", self.sources_key().encode())]
        for lib in _host_libraries(self):
            try:
                st = Path(lib).stat()
            except OSError as exc:
                raise ImageError(f"cannot read host library {lib}: {exc.strerror}") from exc
            items.append((f"lib {lib}", f"{st.st_size} {st.st_mtime_ns}".encode()))
        return cache.hash_inputs(items)


def _find_busybox() -> Path:
    env = os.environ.get("QPROBE_BUSYBOX")
    candidates = [Path(env)] if env else [Path("/bin/busybox"), Path(shutil.which("busybox") or "/nonexistent")]
    for path in candidates:
        if path.is_file():
            return path
    raise ImageError("busybox not found: install busybox-static (or set QPROBE_BUSYBOX to a static busybox)")


def guest_sources() -> GuestFiles:
    """The guest's inputs: ``scripts/guest/`` of this checkout and the host's busybox.

    ``$QPROBE_GUEST_SRC`` names another directory holding workload.c, init,
    uprog.c and libqpt.c.
    """
    env = os.environ.get("QPROBE_GUEST_SRC")
    src = Path(env).expanduser() if env else Path(__file__).resolve().parents[2] / "scripts" / "guest"
    files = GuestFiles(
        workload_c=src / "workload.c",
        init=src / "init",
        busybox=_find_busybox(),
        uprog_c=src / "uprog.c",
        libqpt_c=src / "libqpt.c",
    )
    for path in (files.workload_c, files.init, files.uprog_c, files.libqpt_c):
        if not path.is_file():
            raise ImageError(f"guest source {path} not found; set QPROBE_GUEST_SRC to the scripts/guest directory")
    return files


def interpreter(path: Path, what: str = "program") -> str | None:
    """The ELF program's PT_INTERP (its dynamic loader's path), None for a static program."""
    data = path.read_bytes()[:4096]
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ImageError(f"{what} {path} is not a 64-bit ELF program")
    phoff = int.from_bytes(data[32:40], "little")
    phentsize = int.from_bytes(data[54:56], "little")
    phnum = int.from_bytes(data[56:58], "little")
    for i in range(phnum):
        off = phoff + i * phentsize
        if off + 40 <= len(data) and int.from_bytes(data[off : off + 4], "little") == 3:  # PT_INTERP
            start = int.from_bytes(data[off + 8 : off + 16], "little")
            size = int.from_bytes(data[off + 32 : off + 40], "little")
            with path.open("rb") as f:
                f.seek(start)
                return f.read(min(size, 4096)).split(b"\0", 1)[0].decode("utf-8", "replace")
    return None


def _check_static(path: Path, what: str, hint: str) -> None:
    """Refuse a dynamically linked binary where the guest must run it without a loader."""
    if interpreter(path, what) is not None:
        raise ImageError(f"{what} {path} is dynamically linked; {hint}")


def _gcc(tmp: Path, args: list[str], what: Path) -> None:
    """Run gcc with ``args`` writing ``tmp``; a failure is one line naming the source."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise ImageError("gcc not found: install gcc and libc6-dev to build the guest programs")
    proc = subprocess.run(
        [gcc, *args, "-o", str(tmp)], capture_output=True, encoding="utf-8", errors="replace", check=False
    )
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if "error" in line] or proc.stderr.splitlines()
        raise ImageError(f"gcc failed on {what}: {errors[0] if errors else 'no output'}")


def _build_workload(src: Path, dest: Path) -> None:
    with cache.atomic_file(dest, 0o755) as tmp:
        _gcc(tmp, ["-static", "-O2", "-Wall", str(src)], src)
        _check_static(tmp, "workload", "gcc could not link it statically (install libc6-dev)")


def _build_uprog(files: GuestFiles, dest: Path) -> None:
    """``uprog-static``, ``libqpt.so`` and ``uprog`` (linked to it) in the directory ``dest``."""
    dest.mkdir(mode=0o755, exist_ok=True)
    with cache.atomic_file(dest / "uprog-static", 0o755) as tmp:
        _gcc(tmp, ["-static", *_CFLAGS, "-DUPROG_STATIC", str(files.uprog_c), str(files.libqpt_c)], files.uprog_c)
        _check_static(tmp, "uprog-static", "gcc could not link it statically (install libc6-dev)")
    with cache.atomic_file(dest / "libqpt.so", 0o755) as tmp:
        _gcc(tmp, ["-shared", "-fPIC", *_CFLAGS, "-Wl,-soname,libqpt.so", str(files.libqpt_c)], files.libqpt_c)
    with cache.atomic_file(dest / "uprog", 0o755) as tmp:
        link = [f"-L{dest}", "-lqpt", f"-Wl,-rpath,{LIBQPT_DIR}"]
        _gcc(tmp, [*_CFLAGS, str(files.uprog_c), *link], files.uprog_c)


def _loader_list(uprog: Path) -> list[str]:
    """The interpreter and the host libraries it loads for ``uprog`` (not libqpt.so)."""
    interp = interpreter(uprog, "uprog")
    if interp is None:
        raise ImageError(f"uprog {uprog} has no interpreter: gcc linked it statically")
    if not Path(interp).is_file():
        raise ImageError(f"uprog's interpreter {interp} is not on this host")
    # A clean environment: no LD_LIBRARY_PATH or LD_PRELOAD of the caller's.
    proc = subprocess.run(
        [interp, "--list", "--library-path", str(uprog.parent), str(uprog)],
        capture_output=True,
        encoding="utf-8",
        errors="replace",
        check=False,
        env={},
    )
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        why = lines[-1].rpartition("error while loading shared libraries: ")[2] if lines else proc.returncode
        raise ImageError(f"the host's loader {interp} cannot load uprog: {why}")
    libs = [interp]
    for line in proc.stdout.splitlines():
        name, arrow, rest = line.strip().partition(" => ")
        if not arrow:
            continue  # the vDSO, and the interpreter by its own path
        path = rest.rsplit(" (", 1)[0].strip()
        if not path.startswith("/"):  # "not found", as ldd shows a missing library
            raise ImageError(f"the host's loader {interp} cannot load uprog: {name} not found")
        if Path(path).parent != uprog.parent:
            libs.append(path)
    return libs


def _host_libraries(files: GuestFiles) -> list[str]:
    """The host libraries the dynamic uprog of these sources loads (remembered per sources hash)."""
    base = files.sources_key()
    root = cache.subdir("guest")
    memo = root / f"libs-{base}"

    def remembered() -> list[str]:
        try:
            libs = memo.read_text().split()
        except OSError:
            return []
        return libs if libs and all(Path(lib).is_file() for lib in libs) else []

    if libs := remembered():
        return libs
    with cache.locked(root, memo.name):
        if libs := remembered():
            return libs
        with tempfile.TemporaryDirectory(prefix="qprobe-uprog.") as tmp:
            _build_uprog(files, Path(tmp))
            libs = _loader_list(Path(tmp) / "uprog")
        with cache.atomic_file(memo) as out:
            out.write_text("".join(f"{lib}\n" for lib in libs))
    cache.prune(root, "libs-*", keep=8, protect=[memo])
    return libs


def _applets(busybox: Path) -> list[str]:
    """Applet paths ("bin/sh", "sbin/poweroff", ...) the busybox binary provides."""
    proc = subprocess.run(
        [str(busybox), "--list-full"], capture_output=True, encoding="utf-8", errors="replace", check=False
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        raise ImageError(f"{busybox} --list-full failed: is it a busybox binary?")
    return [line.strip() for line in proc.stdout.splitlines() if "/" in line.strip()]


def _install(tree: Path, guest: str, src: Path) -> None:
    """Copy ``src`` (its bytes, through symlinks) to the guest path ``guest``, mode 0755."""
    dest = tree / guest.lstrip("/")
    for parent in reversed(dest.relative_to(tree).parents[:-1]):
        if not (tree / parent).is_dir():
            (tree / parent).mkdir()
            (tree / parent).chmod(0o755)
    try:
        shutil.copyfile(src, dest)
    except OSError as exc:
        raise ImageError(f"cannot copy {src} into the guest: {exc.strerror}") from exc
    dest.chmod(0o755)


def _build_tree(files: GuestFiles, built: Path, dest: Path) -> None:
    """The root filesystem as a host directory (owners are fixed up per form)."""
    _check_static(files.busybox, "busybox", "install busybox-static")
    with cache.atomic_dir(dest) as tree:
        tree.chmod(0o755)
        for name, mode in _DIRS.items():
            (tree / name).mkdir(parents=True, exist_ok=True)
            (tree / name).chmod(mode)
        shutil.copyfile(files.busybox, tree / "bin/busybox")
        (tree / "bin/busybox").chmod(0o755)
        shutil.copyfile(built / "workload", tree / "bin/workload")
        (tree / "bin/workload").chmod(0o755)
        _install(tree, "/bin/uprog-static", built / "uprog" / "uprog-static")
        _install(tree, "/bin/uprog", built / "uprog" / "uprog")
        _install(tree, f"{LIBQPT_DIR}/libqpt.so", built / "uprog" / "libqpt.so")
        for lib in _loader_list(built / "uprog" / "uprog"):
            _install(tree, lib, Path(lib))
        shutil.copyfile(files.init, tree / "init")
        (tree / "init").chmod(0o755)
        for name, text in _ETC.items():
            (tree / name).write_text(text)
            (tree / name).chmod(0o644)
        for applet in _applets(tree / "bin/busybox"):
            link = tree / applet
            if link.exists() or link.is_symlink():
                continue  # never replace busybox itself
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to("/bin/busybox")


def _guest_dir(files: GuestFiles, reporter: Reporter) -> Path:
    """The build directory with ``workload``, ``uprog/`` and ``tree`` in it (built if missing)."""
    key = files.key()
    root = cache.subdir("guest")
    directory = root / key
    if (directory / "tree").is_dir() and (directory / "workload").is_file():
        cache.touch(directory)
        return directory
    with cache.locked(root, key):
        directory.mkdir(mode=0o700, exist_ok=True)
        cache.remove_leftovers(directory)
        if not (directory / "workload").is_file():
            reporter.note("building the guest workload (gcc -static)")
            _build_workload(files.workload_c, directory / "workload")
        if not (directory / "uprog" / "uprog").is_file():
            reporter.note("building the guest uprog programs (gcc)")
            _build_uprog(files, directory / "uprog")
        if not (directory / "tree").is_dir():
            _build_tree(files, directory, directory / "tree")
    cache.prune(root, "[0-9a-f]*", keep=4, protect=[directory], min_age=24 * 3600)
    return directory


def guest_tree(reporter: Reporter | None = None, files: GuestFiles | None = None) -> Path:
    """The guest's root tree on the host (built if missing): the same bytes as the guest's files."""
    return _guest_dir(files or guest_sources(), reporter or Reporter(enabled=False)) / "tree"


def build_initramfs(reporter: Reporter, files: GuestFiles | None = None) -> Path:
    """The gzip'd newc initramfs of the guest tree (cached)."""
    files = files or guest_sources()
    directory = _guest_dir(files, reporter)
    dest = directory / "initramfs.cpio.gz"
    if dest.is_file():
        return dest
    with cache.locked(directory.parent, directory.name):
        if dest.is_file():
            return dest
        reporter.note("building the guest initramfs")
        writer = CpioWriter()
        writer.add_tree(directory / "tree")
        writer.add_chardev("/dev/console", 5, 1, 0o600)
        data = gzip.compress(writer.finish(), compresslevel=6, mtime=0)
        with cache.atomic_file(dest) as tmp:
            tmp.write_bytes(data)
    return dest


def build_disk(reporter: Reporter, files: GuestFiles | None = None) -> Path:
    """A raw ext2 image of the guest tree (cached), made by ``mke2fs -d``."""
    files = files or guest_sources()
    directory = _guest_dir(files, reporter)
    dest = directory / "rootfs.ext2"
    if dest.is_file():
        return dest
    with cache.locked(directory.parent, directory.name):
        if dest.is_file():
            return dest
        reporter.note("building the guest disk image (mke2fs -t ext2)")
        make_ext2(directory / "tree", dest, "qprobe")
    return dest


def make_ext2(tree: Path, dest: Path, label: str) -> None:
    """A raw ext2 image of ``tree`` at ``dest`` (atomically), by ``mke2fs -d``: the same tree, the same bytes."""
    mke2fs = shutil.which("mke2fs") or shutil.which("mke2fs", path="/sbin:/usr/sbin")
    if mke2fs is None:
        raise ImageError("mke2fs not found: install e2fsprogs to build the guest disk image")
    used = sum(p.lstat().st_size for p in tree.rglob("*"))
    size_kib = max(DISK_MIN_BYTES, used * 2 + (8 << 20)) // 1024
    with cache.atomic_file(dest) as tmp:
        tmp.unlink()  # mke2fs creates the file itself, with the size given
        # Fixed UUID: the same tree gives the same image.
        args = ["-q", "-F", "-t", "ext2", "-b", "1024", "-m", "0", "-L", label]
        args += ["-U", "00000000-0000-4000-8000-00000071b0be", "-E", "root_owner=0:0"]
        proc = subprocess.run(
            [mke2fs, *args, "-d", str(tree), str(tmp), f"{size_kib}k"],
            capture_output=True,
            encoding="utf-8",
            errors="replace",
            check=False,
        )
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines()
            raise ImageError(f"mke2fs -d {tree} failed: {lines[-1] if lines else proc.returncode}")
