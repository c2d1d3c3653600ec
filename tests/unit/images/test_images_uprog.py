"""The guest's uprog programs (no VM): built into the tree with the loader and libraries they need, and cached."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from qprobe.errors import ImageError
from qprobe.images import guest
from qprobe.images.progress import Reporter

pytestmark = pytest.mark.skipif(
    not (shutil.which("gcc") and os.path.exists("/bin/busybox") and shutil.which("readelf")),
    reason="needs gcc, /bin/busybox and readelf",
)


def _tree(cache: Path) -> Path:
    guest.build_initramfs(Reporter(False))
    (tree,) = (cache / "guest").glob("*/tree")
    return tree


def _dynamic(path: Path, tag: str) -> list[str]:
    """readelf's values of one dynamic tag (NEEDED, RUNPATH) of an ELF file."""
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return re.findall(rf"\({tag}\)\s+\S+ \S+: \[([^]]*)\]", out)


def _system_dirs(interp: str) -> list[str]:
    """The loader's own default search path, from its --help (glibc 2.33 and later)."""
    out = subprocess.run([interp, "--help"], capture_output=True, text=True, check=False).stdout
    dirs = re.findall(r"^\s+(/\S+) \(system search path\)$", out, re.M)
    if not dirs:
        pytest.skip(f"{interp} --help lists no system search path")
    return dirs


def test_programs_and_what_they_load_are_in_the_tree(_isolated_images: Path) -> None:
    tree = _tree(_isolated_images)
    for name in ("bin/uprog", "bin/uprog-static", "usr/lib/libqpt.so"):
        assert (tree / name).is_file() and os.access(tree / name, os.X_OK), name
    assert guest.interpreter(tree / "bin/uprog-static") is None
    interp = guest.interpreter(tree / "bin/uprog")
    assert interp and (tree / interp.lstrip("/")).is_file() and not (tree / interp.lstrip("/")).is_symlink()
    assert _dynamic(tree / "bin/uprog", "RUNPATH") == ["/usr/lib"]
    # Every DT_NEEDED of the program and of each library it pulls in, looked up as the guest's loader does
    # without an ld.so.cache: RUNPATH, then the loader's system directories; its own name is the loader.
    search = ["/usr/lib", *_system_dirs(interp)]
    todo, seen = ["/bin/uprog"], set()
    while todo:
        path = todo.pop()
        for name in _dynamic(tree / path.lstrip("/"), "NEEDED"):
            if name == Path(interp).name or name in seen:
                continue
            seen.add(name)
            found = [f"{d}/{name}" for d in search if (tree / d.lstrip("/") / name).is_file()]
            assert found, f"{name} (needed by {path}) is nowhere in the guest's search path {search}"
            todo.append(found[0])
    assert {"libqpt.so", "libc.so.6"} <= seen


def test_dynamic_program_runs_with_the_tree_libraries(_isolated_images: Path) -> None:
    tree = _tree(_isolated_images)
    interp = str(tree / str(guest.interpreter(tree / "bin/uprog")).lstrip("/"))
    dirs = ":".join(str(tree / d.lstrip("/")) for d in ["/usr/lib", *_system_dirs(interp)])
    cmd = [interp, "--inhibit-cache", "--library-path", dirs]
    listed = subprocess.run([*cmd, "--list", str(tree / "bin/uprog")], capture_output=True, text=True, env={})
    resolved = re.findall(r"=> (\S+) \(", listed.stdout)
    assert resolved and all(p.startswith(str(tree)) for p in resolved), listed.stdout
    out = subprocess.run([*cmd, str(tree / "bin/uprog"), "lib", "3", "10", "5"], capture_output=True, text=True)
    assert out.returncode == 0
    assert re.fullmatch(r"uprog mode=lib build=dynamic n=3 pid=\d+ ret=17 calls=3 bad=0 a=10 b=5\n", out.stdout)


def test_static_program_modes_and_usage(_isolated_images: Path) -> None:
    prog = _tree(_isolated_images) / "bin/uprog-static"
    out = subprocess.run([prog, "call", "3", "10", "5", "hi"], capture_output=True, text=True).stdout
    assert re.fullmatch(r"uprog mode=call build=static n=3 pid=\d+ ret=17 calls=3 bad=0 a=10 b=5 s=hi\n", out)
    out = subprocess.run([prog, "recurse", "20"], capture_output=True, text=True).stdout
    assert " ret=20 calls=21 bad=0" in out
    for bad_args in (["bogus"], ["call", "1", "x", "2", "s"], ["recurse", "99999999"], ["threads", "65", "1"]):
        assert subprocess.run([prog, *bad_args], capture_output=True).returncode == 2, bad_args
    symbols = subprocess.run(["readelf", "-sW", str(prog)], capture_output=True, text=True, check=True).stdout
    assert {"qpt_target", "qpt_recurse", "qpt_lib_add"} <= set(re.findall(r" FUNC +GLOBAL +\S+ +\S+ (\w+)", symbols))


def test_key_covers_uprog_sources_and_host_libraries(
    _isolated_images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "guest-src"
    shutil.copytree(Path(guest.__file__).resolve().parents[2] / "scripts" / "guest", src)
    monkeypatch.setenv("QPROBE_GUEST_SRC", str(src))
    files = guest.guest_sources()
    first = files.key()
    with (src / "libqpt.c").open("a") as f:
        f.write("/* changed */\n")
    assert files.key() != first
    # A host library's size or mtime: the remembered list names one here, then it changes.
    lib = tmp_path / "libfake.so.1"
    lib.write_bytes(b"x")
    (_isolated_images / "guest" / f"libs-{files.sources_key()}").write_text(f"{lib}\n")
    before = files.key()
    os.utime(lib, ns=(1, 1))
    assert files.key() != before


def test_missing_tools_and_libraries_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A library the loader cannot find.
    (tmp_path / "lib").mkdir()
    (tmp_path / "bin").mkdir()
    (tmp_path / "foo.c").write_text("int foo(void) { return 1; }\n")
    (tmp_path / "main.c").write_text("int foo(void);\nint main(void) { return foo(); }\n")
    lib = tmp_path / "lib" / "libqptmissing.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", lib, tmp_path / "foo.c"], check=True)
    prog = tmp_path / "bin" / "uprog"
    subprocess.run(["gcc", "-o", prog, tmp_path / "main.c", f"-L{lib.parent}", "-lqptmissing"], check=True)
    with pytest.raises(ImageError, match=r"^the host's loader \S+ cannot load uprog: libqptmissing\.so: cannot open"):
        guest._loader_list(prog)
    # No gcc.
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    src = Path(guest.__file__).resolve().parents[2] / "scripts" / "guest"
    files = guest.GuestFiles(
        src / "workload.c", src / "init", Path("/bin/busybox"), src / "uprog.c", src / "libqpt.c", "x86_64"
    )
    with pytest.raises(ImageError, match=r"^gcc not found: install gcc and libc6-dev"):
        guest._build_uprog(files, tmp_path / "out")
