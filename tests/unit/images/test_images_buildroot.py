"""A buildroot output/ directory as an image: the files found where buildroot leaves them, start-qemu.sh read."""

from __future__ import annotations

from pathlib import Path

import pytest
from images_fakes import fake_bzimage, fake_config, fake_disk, fake_initrd, fake_vmlinux

from qprobe.cli import main
from qprobe.errors import ImageError
from qprobe.images import get_image, list_images
from qprobe.images.buildroot import parse_start_qemu

# board/qemu/x86_64's readme line as post-image.sh turns it into images/start-qemu.sh
# (board/qemu/start-qemu.sh.in, buildroot 2025.x).
START_QEMU = """#!/bin/sh

BINARIES_DIR="${0%/*}/"
# shellcheck disable=SC2164
cd "${BINARIES_DIR}"

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

if ${mode_serial}; then
    EXTRA_ARGS='-nographic'
else
    EXTRA_ARGS='-serial stdio'
fi

if ! ${mode_sys_qemu}; then
    export PATH="/home/u/br/output/host/bin:${PATH}"
fi

exec qemu-system-x86_64 -M pc -kernel bzImage -drive file=rootfs.ext2,if=virtio,format=raw \
-append "rootwait root=/dev/vda console=tty1 console=ttyS0"  -net nic,model=virtio -net user  ${EXTRA_ARGS} "$@"
"""


def output_tree(root: Path, *, script: str | None = START_QEMU, linux: tuple[str, ...] = ("linux-6.6.32",),
                rootfs: tuple[str, ...] = ("rootfs.ext2",), config: tuple[str, ...] = ("CONFIG_VIRTIO_BLK=y",
                "CONFIG_VIRTIO_PCI=y")) -> Path:  # fmt: skip
    """A buildroot output/ directory as buildroot leaves it (and a linux-headers build beside the kernel's)."""
    out = root / "output"
    images = out / "images"
    images.mkdir(parents=True)
    fake_bzimage(images / "bzImage")
    for name in rootfs:
        (fake_disk if "ext" in name else fake_initrd)(images / name)
    if script is not None:
        (images / "start-qemu.sh").write_text(script)
    (out / "build" / "linux-headers-6.6.32").mkdir(parents=True)
    for name in linux:
        build = out / "build" / name
        build.mkdir(parents=True)
        fake_vmlinux(build / "vmlinux")
        fake_config(build / ".config", *config)
        (build / "System.map").write_text("ffffffff81000000 T _stext\n")
    return out


def define(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    manifest = tmp_path / "user" / "images.toml"
    manifest.parent.mkdir(exist_ok=True)
    manifest.write_text(body)
    monkeypatch.setenv("QPROBE_IMAGES", str(manifest))


def test_start_qemu_of_the_x86_64_board(tmp_path: Path) -> None:
    found = parse_start_qemu(START_QEMU, tmp_path)
    assert (found.binary, found.machine, found.kernel, found.disk, found.disk_interface, found.initrd) == (
        "qemu-system-x86_64", "pc", tmp_path / "bzImage", tmp_path / "rootfs.ext2", "virtio", None)  # fmt: skip
    assert found.cmdline == "rootwait root=/dev/vda console=tty1 console=ttyS0"


@pytest.mark.parametrize(
    ("line", "interface"),
    [
        # aarch64-virt's form: a drive without interface, attached by a -device
        ("-drive file=rootfs.ext4,if=none,format=raw,id=hd0 -device virtio-blk-device,drive=hd0", "virtio"),
        ("-drive file=rootfs.ext2,if=none,id=d0,format=raw -device nvme,drive=d0,serial=x", "nvme"),
        ("-drive file=rootfs.ext2,format=raw", "ide"),  # no if=: the pc machine's IDE
        ("-drive file=rootfs.ext2,if=scsi,index=0,format=raw", "scsi"),
        ("-hda rootfs.ext2", "ide"),
    ],
)
def test_start_qemu_disk_interfaces(tmp_path: Path, line: str, interface: str) -> None:
    script = f"exec qemu-system-x86_64 -M pc -kernel bzImage {line} -append 'root=/dev/vda'\n"
    found = parse_start_qemu(script, tmp_path)
    assert found.disk_interface == interface and found.disk is not None and found.disk.name.startswith("rootfs.")


def test_start_qemu_of_older_buildroot(tmp_path: Path) -> None:
    """Before start-qemu.sh.in cd'd into images/, paths were ${IMAGE_DIR}/NAME."""
    text = ('IMAGE_DIR="${0%/*}/"\nexec qemu-system-x86_64 -M pc -kernel ${IMAGE_DIR}/bzImage '
            '-initrd ${IMAGE_DIR}/rootfs.cpio.gz -append "console=ttyS0" ${EXTRA_ARGS}\n')  # fmt: skip
    found = parse_start_qemu(text, tmp_path)
    assert (found.kernel, found.initrd, found.disk) == (tmp_path / "bzImage", tmp_path / "rootfs.cpio.gz", None)


def test_start_qemu_without_a_command(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="has no qemu-system-\\* command line"):
        parse_start_qemu("#!/bin/sh\necho hi\n", tmp_path)


def test_buildroot_key_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = output_tree(tmp_path)
    define(tmp_path, monkeypatch, '[images.br]\nbuildroot = "../output"\n')  # relative to the manifest
    img = get_image("br")
    linux = out / "build" / "linux-6.6.32"
    assert (img.kernel, img.disk, img.initrd) == (out / "images" / "bzImage", out / "images" / "rootfs.ext2", None)
    assert (img.vmlinux, img.config, img.system_map) == (linux / "vmlinux", linux / ".config", linux / "System.map")
    assert img.disk_interface == "virtio"
    # start-qemu.sh's command line without its console= (qprobe's console is the first serial port)
    assert img.cmdline == "rootwait root=/dev/vda"
    assert [(i.name, i.state) for i in list_images() if i.name == "br"] == [("br", "ready")]


def test_explicit_keys_win(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = output_tree(tmp_path, rootfs=("rootfs.ext2", "rootfs.cpio.gz"))
    other = fake_vmlinux(tmp_path / "my-vmlinux")
    define(tmp_path, monkeypatch, f'[images.br]\nbuildroot = "{out}"\nvmlinux = "{other}"\n'
           f'initrd = "{out}/images/rootfs.cpio.gz"\ncmdline = "quiet"\n')  # fmt: skip
    img = get_image("br")
    assert (img.vmlinux, img.initrd, img.disk, img.cmdline) == (other, out / "images" / "rootfs.cpio.gz", None, "quiet")
    define(tmp_path, monkeypatch, f'[images.br]\nbuildroot = "{out}"\ndisk_interface = "nvme"\n')
    img = get_image("br")
    assert (img.disk_interface, img.cmdline) == ("nvme", "rootwait root=/dev/vda")


def test_without_start_qemu_the_config_decides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = output_tree(tmp_path, script=None)
    define(tmp_path, monkeypatch, f'[images.br]\nbuildroot = "{out}"\n')
    img = get_image("br")
    assert (img.disk_interface, img.cmdline) == ("virtio", "root=/dev/vda rootwait rw")
    nvme = output_tree(tmp_path / "n", script=None, config=("CONFIG_BLK_DEV_NVME=y", "CONFIG_VIRTIO_BLK=y"))
    define(tmp_path, monkeypatch, f'[images.br]\nbuildroot = "{nvme}"\n')
    assert get_image("br").disk_interface == "nvme"
    neither = output_tree(tmp_path / "x", script=None, config=("CONFIG_VIRTIO_BLK=m", "CONFIG_BLK_DEV_NVME=m"))
    define(tmp_path, monkeypatch, f'[images.br]\nbuildroot = "{neither}"\n')
    with pytest.raises(ImageError) as exc:
        get_image("br")
    text = str(exc.value)
    assert "\n" not in text and "CONFIG_VIRTIO_BLK=y" in text and "CONFIG_BLK_DEV_NVME=y" in text
    assert str(neither / "build" / "linux-6.6.32" / ".config") in text


def test_a_files_disk_without_interface_follows_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only buildroot's: a disk given by files, no disk_interface (before: always NVMe)."""
    kernel, vmlinux = fake_bzimage(tmp_path / "bzImage"), fake_vmlinux(tmp_path / "vmlinux")
    disk = fake_disk(tmp_path / "rootfs.ext2")
    config = fake_config(tmp_path / "config", "CONFIG_VIRTIO_BLK=y", "CONFIG_VIRTIO_PCI=y")
    define(tmp_path, monkeypatch, f'[images.k]\nkernel = "{kernel}"\nvmlinux = "{vmlinux}"\ndisk = "{disk}"\n'
           f'config = "{config}"\n')  # fmt: skip
    assert get_image("k").disk_interface == "virtio"
    define(tmp_path, monkeypatch, f'[images.k]\nkernel = "{kernel}"\nvmlinux = "{vmlinux}"\ndisk = "{disk}"\n')
    assert get_image("k").disk_interface == "nvme"  # no config: NVMe, as before


def test_an_initramfs_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = output_tree(tmp_path, script=None, rootfs=("rootfs.cpio.gz",), config=("CONFIG_SMP=y",))
    define(tmp_path, monkeypatch, f'[images.br]\nbuildroot = "{out}"\n')
    img = get_image("br")
    assert (img.initrd, img.disk, img.cmdline) == (out / "images" / "rootfs.cpio.gz", None, "")


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ({"linux": ()}, r"no vmlinux in .*/build/linux-\*/ \(found linux-headers-6\.6\.32, none with a vmlinux\)"),
        (
            {"linux": ("linux-6.6.32", "linux-6.12.1")},
            r"several kernel builds have a vmlinux \(linux-6\.12\.1, "
            r"linux-6\.6\.32\): name one with vmlinux =",
        ),
        (
            {"script": START_QEMU.replace("if=virtio", "if=ide")},
            r"attaches the root disk as 'ide'; qprobe attaches "
            r"it as 'virtio' or 'nvme'",
        ),
        (
            {"script": START_QEMU.replace("x86_64 -M pc", "aarch64 -M virt")},
            "runs qemu-system-aarch64: qprobe boots x86-64 kernels",
        ),
        ({"script": START_QEMU.replace("-M pc", "-M microvm")}, "boots QEMU's 'microvm' machine"),
    ],
)
def test_what_is_wrong_is_said_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tree: dict[str, object],
                                           message: str) -> None:  # fmt: skip
    out = output_tree(tmp_path, **tree)  # type: ignore[arg-type]
    define(tmp_path, monkeypatch, f'[images.br]\nbuildroot = "{out}"\n')
    with pytest.raises(ImageError, match=message) as exc:
        get_image("br")
    assert "\n" not in str(exc.value)


def test_not_an_output_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    define(tmp_path, monkeypatch, f'[images.br]\nbuildroot = "{tmp_path / "nowhere"}"\n')
    assert [(i.name, i.state) for i in list_images() if i.name == "br"] == [("br", "not fetched")]
    with pytest.raises(ImageError, match=r"buildroot output .*nowhere does not exist: give buildroot's output/"):
        get_image("br")
    define(tmp_path, monkeypatch, f'[images.br]\nbuildroot = "{tmp_path}"\n')
    with pytest.raises(ImageError, match="has no images/ directory"):
        get_image("br")


def test_images_add(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    out = output_tree(tmp_path / "my br")
    manifest = tmp_path / "conf" / "images.toml"
    monkeypatch.setenv("QPROBE_IMAGES", str(manifest))
    assert main(["images", "add", "br", "--buildroot", str(out), "--description", 'my "board"']) == 0
    said = capsys.readouterr().out
    assert f"added image br to {manifest}" in said and "the disk is attached as virtio" in said
    assert get_image("br").kernel == out / "images" / "bzImage"
    assert [i.description for i in list_images() if i.name == "br"] == ['my "board"']
    assert main(["images", "add", "br", "--buildroot", str(out)]) == 2  # the name is taken
    assert "exists already" in capsys.readouterr().err
    assert main(["images", "add", "br2", "--buildroot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "has no images/ directory" in err and len(err.splitlines()) == 1
    assert "br2" not in manifest.read_text()
    assert main(["images", "add", "my.br", "--buildroot", str(out)]) == 0  # a key TOML must quote
    assert manifest.read_text().startswith(f'[images.br]\nbuildroot = "{out}"\n')
    assert get_image("my.br").kernel == out / "images" / "bzImage"
