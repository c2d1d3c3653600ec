"""A kprobe_events line's words rewritten before its arguments are parsed (kernel/trace/trace_probe.c).

Where the running kernel's :class:`~qprobe.fetch.dialect.Dialect` has them:
bare ``$argN`` and ``$arg*`` become the function's parameters by its BTF
prototype (``traceprobe_expand_meta_args``, Linux 6.5 on), and ``ARG:%pd`` /
``ARG:%pD`` the fetch of a dentry's or a file's name
(``traceprobe_expand_dentry_args``).
"""

from __future__ import annotations

from qprobe.errors import FetchArgError

from . import messages as M
from .command import Command
from .expr import is_function_entry, is_function_return
from .kstrto import isdigit, simple_strtoul


def expand_meta_args(cmd: Command, words: list[str], flags: int, func: str | None) -> list[str]:
    """``traceprobe_expand_meta_args`` (Linux 6.5 on): bare ``$argN`` and ``$arg*`` words by BTF.

    Every word starting with ``$arg`` is checked before any argument is parsed.
    Where the function has a BTF prototype, ``$argN[:TYPE]`` becomes the Nth
    parameter's name (``file``, ``buf:string``) and ``$arg*`` all of them; without
    one, ``$argN`` stays (parsed as the Nth argument register) and ``$arg*`` is refused.
    """
    args_idx, found, last = -1, False, 0
    for i, word in enumerate(words):
        if not word.startswith("$arg"):
            continue
        last = i + 2
        # Exits too where the README says return probes take $arg<N> (6.12's selftest expects
        # NOFENTRY_ARGS for 'r vfs_read $arg*' on a kernel whose README does not).
        if not (is_function_entry(flags) or (is_function_return(flags) and cmd.dialect.return_args)):
            raise cmd.error(last, 0, M.NOFENTRY_ARGS)
        if isdigit(word[4:5]):
            found = True
            continue
        if word[4:5] != "*":
            raise cmd.error(last, 0, M.BAD_VAR)
        if args_idx >= 0:
            raise cmd.error(last, 0, M.DOUBLE_ARGS)
        found, args_idx = True, i
    if not found:
        return words
    proto = cmd.dialect.proto(func)
    if proto is None or not proto.params:
        if args_idx >= 0:  # $arg* needs BTF
            raise cmd.error(last, 0, M.NOSUP_BTFARG)
        return words
    out: list[str] = []
    used = 0

    def nth(n: int, suffix: str, index: int) -> str:  # sprint_nth_btf_arg, into one MAX_BTF_ARGS_LEN buffer
        nonlocal used
        if n >= len(proto.params):
            raise cmd.error(index, 0, M.NO_BTFARG)
        text = proto.params[n][0] + suffix
        if len(text) >= M.MAX_BTF_ARGS_LEN - used:
            raise cmd.error(index, 0, M.ARGS_2LONG)
        used += len(text) + 1
        return text

    for i, word in enumerate(words):
        if i == args_idx:
            out += [nth(n, "", i + 2) for n in range(len(proto.params))]
        elif word.startswith("$arg"):
            n, end = simple_strtoul(word[4:], 10)
            suffix = word[4 + end :]
            if suffix[:1] not in ("", ":"):
                raise cmd.error(i + 2, 0, M.BAD_VAR)
            if n == 0:  # $argN counts from 1
                raise cmd.error(i + 2, 0, M.BAD_ARG_NUM)
            out.append(nth(n - 1, suffix, i + 2))
        else:
            out.append(word)
    return out


def expand_dentry_arg(cmd: Command, word: str) -> str:
    """``traceprobe_expand_dentry_args``: ``[NAME=]ARG:%pd`` is the dentry's name, ``:%pD`` the file's.

    They become ``+0x0(+0xOFF(ARG)):string`` with the offsets of ``struct dentry``'s
    ``d_name.name`` and ``struct file``'s ``f_path.dentry``, here from the kernel's BTF.
    """
    btf = cmd.dialect.btf
    name_at = None if btf is None else btf.offsetof("dentry", "d_name.name")
    dentry_at = None if btf is None else btf.offsetof("file", "f_path.dentry")
    if name_at is None or dentry_at is None:
        raise FetchArgError("qprobe: %pd/%pD need struct dentry's and struct file's layout, which this kernel's "
                            "BTF does not give", cmd.text, 0, logged=False)  # fmt: skip
    eq = word.find("=")
    head, body = (word[: eq + 1], word[eq + 1 : -4]) if eq >= 0 else ("", word[:-4])
    if word.endswith("d"):
        return f"{head}+0x0(+0x{name_at:x}({body})):string"
    return f"{head}+0x0(+0x{name_at:x}(+0x{dentry_at:x}({body}))):string"
