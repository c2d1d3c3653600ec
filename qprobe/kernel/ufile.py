"""The guest's files as the kernel holds them: dentries, inodes, the page cache and the mappings of a file.

What user-space probes need from the running Linux, read through drgn with the VM stopped:

* a path's inode, from the dentry cache (``path_lookup``): the kernel's own uprobe_events does a
  ``kern_path`` that can read the disk; the host can only find what the guest has looked up;
* a file's bytes, from its page cache (``mapping->i_pages``), so an ELF's symbols and the instruction
  at a probe's offset are read as the guest has them, never from a host copy that could differ;
* every current mapping of a file, from its ``mapping->i_mmap`` interval tree, as ``register_for_each_vma``
  (kernel/events/uprobes.c) finds them;
* for a physical page, the file page it caches (``page->mapping``, ``page->index``), and for an address
  of a process, the mapping and file offset its vma gives;
* a process's own memory (``access_remote_vm`` over its ``mm``), for what its dynamic loader wrote there.

A large folio (Linux 5.16 on) is one ``i_pages`` entry for several indices; its tail pages' ``mapping``
is not the file's, so a page is read through its head (``compound_head``, bit 0 of the tail's field).
"""

from __future__ import annotations

from dataclasses import dataclass

import drgn
from drgn.helpers.linux.fs import path_lookup
from drgn.helpers.linux.mm import access_remote_vm, vma_find
from drgn.helpers.linux.rbtree import rbtree_inorder_for_each_entry
from drgn.helpers.linux.xarray import xa_is_value, xa_load

from qprobe.errors import QprobeError
from qprobe.fetch.uevent import FileKind

__all__ = ["GuestFile", "Mapping", "UserFiles"]

S_IFMT, S_IFREG, S_IFLNK = 0o170000, 0o100000, 0o120000
MAXSYMLINKS = 40  # include/linux/namei.h: links one path lookup follows
PATH_MAX = 4096
# include/linux/mm.h, unchanged since Linux 2.6: the flags valid_vma() (kernel/events/uprobes.c) tests.
VM_WRITE, VM_MAYEXEC, VM_MAYSHARE, VM_HUGETLB = 0x2, 0x40, 0x80, 0x400000
MAX_MAPPINGS = 1 << 16  # a hostile guest's interval tree is not walked forever


@dataclass(frozen=True)
class GuestFile:
    """A regular file of the guest: the inode and its address_space, by address."""

    path: str
    inode: int
    mapping: int
    size: int
    ino: int
    generation: int  # with ino, tells this file from a later one whose inode reuses the same memory


@dataclass(frozen=True)
class Mapping:
    """One vma mapping a file: ``[start, end)`` shows the file from byte ``file_start`` on (vm_pgoff's)."""

    mm: int
    start: int
    end: int
    file_start: int
    flags: int

    def address_of(self, offset: int) -> int | None:
        """The virtual address of file byte ``offset`` in this mapping, if it maps it."""
        rel = offset - self.file_start
        return self.start + rel if 0 <= rel < self.end - self.start else None

    @property
    def probeable(self) -> bool:
        """valid_vma(vma, true): a private, read-only, possibly executable file mapping, not hugetlb."""
        return self.flags & (VM_HUGETLB | VM_MAYEXEC | VM_MAYSHARE | VM_WRITE) == VM_MAYEXEC


class UserFiles:
    """Files, pages and mappings of the guest, on its drgn ``Program``."""

    def __init__(self, prog: drgn.Program) -> None:
        self.prog = prog
        self.page_size = int(prog["PAGE_SIZE"])  # drgn's, from the kernel's VMCOREINFO
        self._vmemmap_obj: drgn.Object | None = None

    def lookup(self, path: str) -> GuestFile | None:
        """The regular file at ``path`` in the dentry cache, or None (not cached, negative, not regular)."""
        inode = self._inode(path)
        if inode is None or int(inode.i_mode) & S_IFMT != S_IFREG:
            return None
        return GuestFile(path, inode.value_(), inode.i_mapping.value_(), int(inode.i_size), int(inode.i_ino),
                         int(inode.i_generation))  # fmt: skip

    def still_there(self, f: GuestFile) -> bool:
        """Whether ``f``'s inode is still that file: the kernel's uprobe holds a reference on it, qprobe cannot,
        so once every user let go the inode is freed and its memory may hold another file's."""
        inode = drgn.Object(self.prog, "struct inode *", value=f.inode)
        try:
            return (int(inode.i_ino), int(inode.i_generation), inode.i_mapping.value_()) == (
                f.ino,
                f.generation,
                f.mapping,
            )
        except drgn.FaultError:
            return False

    def file_kind(self, path: str) -> FileKind:
        """``regular``, ``other`` or ``missing``: what ``kern_path`` and ``d_is_reg`` would tell the parser."""
        inode = self._inode(path)
        if inode is None:
            return "missing"
        return "regular" if int(inode.i_mode) & S_IFMT == S_IFREG else "other"

    def _inode(self, path: str) -> drgn.Object | None:
        """The inode ``kern_path(path, LOOKUP_FOLLOW)`` finds: symbolic links followed, the last one too.

        drgn's path_lookup follows none, so the path is walked a component at a
        time and a link's target (``i_link``, or its page cache for page symlinks
        such as ramfs's) replaces it, at most MAXSYMLINKS times as namei allows.
        """
        if not path.startswith("/") or "\0" in path:
            return None
        todo = [p for p in path.split("/") if p]
        done: list[str] = []
        inode: drgn.Object | None = self._lookup("/")
        links = 0
        while todo:
            part = todo.pop(0)
            if part in (".", ".."):
                if part == ".." and done:
                    done.pop()
                continue
            inode = self._lookup("/" + "/".join([*done, part]))
            if inode is None:
                return None
            if int(inode.i_mode) & S_IFMT != S_IFLNK:
                done.append(part)
                continue
            links += 1
            target = self._link_target(inode)
            if target is None or links > MAXSYMLINKS:
                return None
            if target.startswith("/"):
                done = []
            todo = [p for p in target.split("/") if p] + todo
        return inode

    def _lookup(self, path: str) -> drgn.Object | None:
        try:
            inode = path_lookup(self.prog, path).dentry.d_inode
        except Exception:  # not in the dentry cache (drgn raises a plain Exception), or a fault on the way
            return None
        return inode if inode else None

    def _link_target(self, inode: drgn.Object) -> str | None:
        """A symbolic link's target: ``inode->i_link`` (inline links), else its first page-cache page."""
        size = int(inode.i_size)
        if not 0 < size < PATH_MAX:
            return None
        try:
            if inode.i_link:
                raw: bytes = self.prog.read(inode.i_link.value_(), size)
            else:
                page = self._cached_page(inode.i_mapping.value_(), 0)
                if page is None:
                    return None
                raw = self._page_bytes(page, 0, size)
        except drgn.FaultError:
            return None
        return raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")

    def read(self, f: GuestFile, offset: int, size: int) -> bytes | None:
        """``size`` bytes of the file from ``offset``, from its page cache; None if a page is not cached."""
        out = bytearray()
        end = min(offset + size, f.size)
        while offset < end:
            page = self._cached_page(f.mapping, offset // self.page_size)
            if page is None:
                return None
            within = offset % self.page_size
            n = min(self.page_size - within, end - offset)
            out += self._page_bytes(page, within, n)
            offset += n
        return bytes(out)

    def _cached_page(self, mapping: int, index: int) -> drgn.Object | None:
        space = drgn.Object(self.prog, "struct address_space *", value=mapping)
        entry = xa_load(space.i_pages.address_of_(), index)
        if not entry or xa_is_value(entry):  # no page, or the shadow an evicted page leaves
            return None
        head = drgn.cast("struct page *", entry)
        return head + (index - int(head.index))  # a large folio: its head, then the page of this index

    def mappings(self, f: GuestFile) -> list[Mapping]:
        """Every vma that maps the file now, from its i_mmap tree."""
        space = drgn.Object(self.prog, "struct address_space *", value=f.mapping)
        out = []
        root = space.i_mmap.rb_root.address_of_()
        for vma in rbtree_inorder_for_each_entry("struct vm_area_struct", root, "shared.rb"):
            out.append(self._mapping(vma))
            if len(out) >= MAX_MAPPINGS:
                break
        return out

    def vma_mapping(self, vma_addr: int) -> tuple[Mapping, int] | None:
        """A ``struct vm_area_struct *``'s file mapping and its file's address_space; None for anonymous memory."""
        vma = drgn.Object(self.prog, "struct vm_area_struct *", value=vma_addr)
        if not vma.vm_file:
            return None
        return self._mapping(vma), vma.vm_file.f_mapping.value_()

    def mapping_at(self, mm: int, addr: int) -> tuple[Mapping, int] | None:
        """The file mapping of ``mm`` at ``addr`` and its file's address_space, if a file is mapped there."""
        vma = vma_find(drgn.Object(self.prog, "struct mm_struct *", value=mm), addr)
        if not vma or not vma.vm_file:
            return None
        return self._mapping(vma), vma.vm_file.f_mapping.value_()

    def read_user(self, mm: int, addr: int, size: int) -> bytes | None:
        """``size`` bytes at ``addr`` in the address space ``mm``; None where it has no page present."""
        try:
            return access_remote_vm(drgn.Object(self.prog, "struct mm_struct *", value=mm), addr, size)
        except drgn.FaultError:
            return None

    @property
    def _vmemmap(self) -> drgn.Object:
        """The kernel's ``struct page`` array (SPARSEMEM_VMEMMAP: ``page = vmemmap + pfn``)."""
        if self._vmemmap_obj is None:
            try:
                self._vmemmap_obj = self.prog["vmemmap"]
            except LookupError:
                # drgn finds ``vmemmap`` through VMCOREINFO; a kernel without one (qprobe writes a few lines for
                # it) still has the variable x86's vmemmap is with CONFIG_RANDOMIZE_MEMORY (Linux 4.8 on).
                try:
                    base = int(self.prog["vmemmap_base"])
                except LookupError:
                    raise QprobeError("uprobes need the kernel's struct page array (vmemmap), which drgn "
                                      "cannot find here") from None  # fmt: skip
                self._vmemmap_obj = drgn.Object(self.prog, "struct page *", value=base)
        return self._vmemmap_obj

    def _pfn_to_page(self, pfn: int) -> drgn.Object:
        return self._vmemmap + pfn

    def _page_bytes(self, page: drgn.Object, within: int, size: int) -> bytes:
        """Bytes of a page's frame, read physically (no direct-map base needed)."""
        pfn = (page.value_() - self._vmemmap.value_()) // drgn.sizeof(page.type_.type)
        return self.prog.read(pfn * self.page_size + within, size, True)  # type: ignore[no-any-return]  # drgn: untyped to mypy

    def page_owner(self, pfn: int) -> tuple[int, int] | None:
        """The (address_space, index) whose page cache page is frame ``pfn``; None for any other page."""
        page = self._pfn_to_page(pfn)
        head_word = int(page.compound_head)
        head = drgn.Object(self.prog, "struct page *", value=head_word - 1) if head_word & 1 else page
        mapping = int(head.mapping)
        if mapping == 0 or mapping & 1:  # none, or an anonymous page's anon_vma (PAGE_MAPPING_ANON)
            return None
        tail = (page.value_() - head.value_()) // drgn.sizeof(page.type_.type)
        return mapping, int(head.index) + tail

    def _mapping(self, vma: drgn.Object) -> Mapping:
        start = int(vma.vm_start)
        return Mapping(vma.vm_mm.value_(), start, int(vma.vm_end), int(vma.vm_pgoff) * self.page_size,
                       int(vma.vm_flags))  # fmt: skip
