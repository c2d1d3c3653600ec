"""The guest's root filesystem: busybox, /init, the workload and uprog programs.

Built on the host without root from ``scripts/guest/`` and a static busybox
of the guest's architecture, into ``<cache>/guest/<hash>/``, where the hash
covers every input (the architecture, workload.c, init, uprog.c, libqpt.c,
the busybox binary, the libraries copied in, this module's layout version):
a change to any of them builds a new directory, an unchanged checkout reuses
the old one. A guest of the host's architecture is built with the host's gcc,
libc and busybox; another with Debian's cross toolchain and C library for it
and Debian's busybox-static of its architecture (qprobe.images.toolchain,
qprobe.images.busybox), the same programs with the same flags.

uprog is built twice: ``/bin/uprog-static`` (``gcc -static``, with libqpt.c
linked in) and ``/bin/uprog``, linked against the host's libc and
``/usr/lib/libqpt.so`` (its RUNPATH). The dynamic program's interpreter and
every library the host's loader resolves for it (``ld.so --list``) are
copied into the tree at the paths the loader gave, which are in its default
search path (the guest has no ld.so.cache); a cross-built program's, found
by its DT_NEEDED in the cross C library, go to that search path too
(``toolchain.cross_libraries``). Which libraries those are is known only
once uprog is linked, so the first build for some sources links it once to
find out and remembers the list in ``libs-<hash>``; the directory's hash
then covers each library's path, size and mtime.

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
from qprobe.images.busybox import applets, busybox_for
from qprobe.images.cpio import CpioWriter
from qprobe.images.elf import interpreter
from qprobe.images.progress import Reporter
from qprobe.images.toolchain import Toolchain, cross_libraries, host_arch, toolchain

__all__ = [
    "GuestFiles",
    "build_disk",
    "build_initramfs",
    "guest_sources",
    "guest_tree",
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
    arch: str  # the guest's, as uname -m names it: "x86_64", "aarch64"

    @property
    def toolchain(self) -> Toolchain:
        """What builds the guest's programs: the host's gcc, or a cross compiler."""
        return toolchain(self.arch)

    def sources_key(self) -> str:
        """Hash of the architecture, the inputs in the checkout and busybox (not the libraries)."""
        items = [("layout", LAYOUT_VERSION.encode()), ("arch", self.arch.encode())]
        for path in (self.workload_c, self.init, self.uprog_c, self.libqpt_c, self.busybox):
            try:
                items.append((path.name, path.read_bytes()))
            except OSError as exc:
                raise ImageError(f"cannot read guest input {path}: {exc.strerror}") from exc
        return cache.hash_inputs(items)

    def key(self) -> str:
        """Hash of every input: the name of this build's cache directory."""
        items = [("sources", self.sources_key().encode())]
        for guest_path, lib in _libraries(self):
            try:
                st = lib.stat()
            except OSError as exc:
                raise ImageError(f"cannot read host library {lib}: {exc.strerror}") from exc
            items.append((f"lib {guest_path} {lib}", f"{st.st_size} {st.st_mtime_ns}".encode()))
        return cache.hash_inputs(items)


def guest_sources(arch: str | None = None, reporter: Reporter | None = None) -> GuestFiles:
    """The inputs of a guest of ``arch`` (the host's by default): ``scripts/guest/`` and a busybox.

    ``$QPROBE_GUEST_SRC`` names another directory holding workload.c, init,
    uprog.c and libqpt.c. The busybox of a foreign architecture is fetched
    on first use (``busybox.busybox_for``).
    """
    chain = toolchain(arch or host_arch())
    env = os.environ.get("QPROBE_GUEST_SRC")
    src = Path(env).expanduser() if env else Path(__file__).resolve().parents[2] / "scripts" / "guest"
    files = GuestFiles(
        workload_c=src / "workload.c",
        init=src / "init",
        busybox=busybox_for(chain, reporter or Reporter(enabled=False)),
        uprog_c=src / "uprog.c",
        libqpt_c=src / "libqpt.c",
        arch=chain.arch,
    )
    for path in (files.workload_c, files.init, files.uprog_c, files.libqpt_c):
        if not path.is_file():
            raise ImageError(f"guest source {path} not found; set QPROBE_GUEST_SRC to the scripts/guest directory")
    return files


def _check_static(path: Path, what: str, hint: str) -> None:
    """Refuse a dynamically linked binary where the guest must run it without a loader."""
    if interpreter(path, what) is not None:
        raise ImageError(f"{what} {path} is dynamically linked; {hint}")


def _gcc(chain: Toolchain, tmp: Path, args: list[str], what: Path) -> None:
    """Run the toolchain's gcc with ``args`` writing ``tmp``; a failure is one line naming the source."""
    gcc = chain.which_gcc()
    proc = subprocess.run(
        [gcc, *args, "-o", str(tmp)], capture_output=True, encoding="utf-8", errors="replace", check=False
    )
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if "error" in line] or proc.stderr.splitlines()
        raise ImageError(f"{chain.gcc} failed on {what}: {errors[0] if errors else 'no output'}")


def _build_workload(chain: Toolchain, src: Path, dest: Path) -> None:
    with cache.atomic_file(dest, 0o755) as tmp:
        _gcc(chain, tmp, ["-static", "-O2", "-Wall", str(src)], src)
        _check_static(tmp, "workload", f"{chain.gcc} could not link it statically (install {chain.packages})")


def _build_uprog(files: GuestFiles, dest: Path) -> None:
    """``uprog-static``, ``libqpt.so`` and ``uprog`` (linked to it) in the directory ``dest``."""
    chain = files.toolchain
    dest.mkdir(mode=0o755, exist_ok=True)
    with cache.atomic_file(dest / "uprog-static", 0o755) as tmp:
        static = ["-static", *_CFLAGS, "-DUPROG_STATIC", str(files.uprog_c), str(files.libqpt_c)]
        _gcc(chain, tmp, static, files.uprog_c)
        _check_static(tmp, "uprog-static", f"{chain.gcc} could not link it statically (install {chain.packages})")
    with cache.atomic_file(dest / "libqpt.so", 0o755) as tmp:
        shared = ["-shared", "-fPIC", *_CFLAGS, "-Wl,-soname,libqpt.so", str(files.libqpt_c)]
        _gcc(chain, tmp, shared, files.libqpt_c)
    with cache.atomic_file(dest / "uprog", 0o755) as tmp:
        link = [f"-L{dest}", "-lqpt", f"-Wl,-rpath,{LIBQPT_DIR}"]
        _gcc(chain, tmp, [*_CFLAGS, str(files.uprog_c), *link], files.uprog_c)


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


def _uprog_libraries(files: GuestFiles, uprog: Path) -> list[tuple[str, Path]]:
    """(guest path, host file) of the loader and the libraries the built ``uprog`` loads (not libqpt.so)."""
    if files.toolchain.native:
        return [(lib, Path(lib)) for lib in _loader_list(uprog)]
    return cross_libraries(uprog, files.toolchain, uprog.parent)


def _libraries(files: GuestFiles) -> list[tuple[str, Path]]:
    """``_uprog_libraries`` of these sources' uprog, remembered per sources hash.

    The memo has a line per library: the guest path, then the host file where it differs.
    """
    base = files.sources_key()
    root = cache.subdir("guest")
    memo = root / f"libs-{base}"

    def remembered() -> list[tuple[str, Path]]:
        try:
            lines = memo.read_text().splitlines()
        except OSError:
            return []
        libs = [(guest, Path(host or guest)) for guest, _, host in (line.partition(" ") for line in lines)]
        return libs if libs and all(host.is_file() for _guest, host in libs) else []

    if libs := remembered():
        return libs
    with cache.locked(root, memo.name):
        if libs := remembered():
            return libs
        with tempfile.TemporaryDirectory(prefix="qprobe-uprog.") as tmp:
            _build_uprog(files, Path(tmp))
            libs = _uprog_libraries(files, Path(tmp) / "uprog")
        with cache.atomic_file(memo) as out:
            out.write_text("".join(f"{guest} {host}\n" if str(host) != guest else f"{guest}\n" for guest, host in libs))
    cache.prune(root, "libs-*", keep=8, protect=[memo])
    return libs


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
        for guest_path, lib in _uprog_libraries(files, built / "uprog" / "uprog"):
            _install(tree, guest_path, lib)
        shutil.copyfile(files.init, tree / "init")
        (tree / "init").chmod(0o755)
        for name, text in _ETC.items():
            (tree / name).write_text(text)
            (tree / name).chmod(0o644)
        for applet in applets(tree / "bin/busybox", files.toolchain):
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
            reporter.note(f"building the {files.arch} guest workload ({files.toolchain.gcc} -static)")
            _build_workload(files.toolchain, files.workload_c, directory / "workload")
        if not (directory / "uprog" / "uprog").is_file():
            reporter.note(f"building the {files.arch} guest uprog programs ({files.toolchain.gcc})")
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
