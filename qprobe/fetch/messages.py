"""Error texts and limits of the kernel's probe-event parser (Linux 6.1, and later ones' new texts).

The texts are copied from the ``ERRORS`` list in kernel/trace/trace_probe.h so
that a user sees exactly what ``/sys/kernel/tracing/error_log`` would show for
the same definition.  A few failures make the kernel return ``-EINVAL``
without logging anything; those use the texts at the end of this module,
which are qprobe's own and are marked as such.
"""

from __future__ import annotations

# --- kernel/trace/trace_probe.h, ERRORS (the kprobe-relevant subset) -------
MAXACT_NO_KPROBE = "Maxactive is not for kprobe"
BAD_MAXACT_TYPE = "Maxactive is only for function exit"  # its later wording
BAD_MAXACT = "Invalid maxactive number"
MAXACT_TOO_BIG = "Maxactive is too big"
BAD_PROBE_ADDR = "Invalid probed address or symbol"
BAD_RETPROBE = "Retprobe address must be an function entry"
BAD_ADDR_SUFFIX = "Invalid probed address suffix"
NO_GROUP_NAME = "Group name is not specified"
GROUP_TOO_LONG = "Group name is too long"
BAD_GROUP_NAME = "Group name must follow the same rules as C identifiers"
NO_EVENT_NAME = "Event name is not specified"
EVENT_TOO_LONG = "Event name is too long"
BAD_EVENT_NAME = "Event name must follow the same rules as C identifiers"
EVENT_EXIST = "Given group/event name is already used by another event"
RETVAL_ON_PROBE = "$retval is not available on probe"
BAD_STACK_NUM = "Invalid stack number"
BAD_ARG_NUM = "Invalid argument number"
BAD_VAR = "Invalid $-valiable specified"
BAD_REG_NAME = "Invalid register name"
BAD_MEM_ADDR = "Invalid memory address"
BAD_IMM = "Invalid immediate value"
IMMSTR_NO_CLOSE = "String is not closed with '\"'"
FILE_ON_KPROBE = "File offset is not available with kprobe"
TOO_MANY_OPS = "Dereference is too much nested"
DEREF_NEED_BRACE = "Dereference needs a brace"
BAD_DEREF_OFFS = "Invalid dereference offset"
DEREF_OPEN_BRACE = "Dereference brace is not closed"
COMM_CANT_DEREF = "$comm can not be dereferenced"
BAD_FETCH_ARG = "Invalid fetch argument"
ARRAY_NO_CLOSE = "Array is not closed"
BAD_ARRAY_SUFFIX = "Array has wrong suffix"
BAD_ARRAY_NUM = "Invalid array size"
ARRAY_TOO_BIG = "Array number is too big"
BAD_TYPE = "Unknown type is specified"
BAD_STRING = "String accepts only memory argument"
BAD_SYMSTRING = "Symbol String doesn't accept data/userdata"
BAD_BITFIELD = "Invalid bitfield"
ARG_NAME_TOO_LONG = "Argument name is too long"
NO_ARG_NAME = "Argument name is not specified"
BAD_ARG_NAME = "Argument name must follow the same rules as C identifiers"
USED_ARG_NAME = "This argument name is already used"
ARG_TOO_LONG = "Argument expression is too long"
NO_ARG_BODY = "No argument expression"
BAD_INSN_BNDRY = "Probe point is not an instruction boundary"
FAIL_REG_PROBE = "Failed to register probe event"
DIFF_PROBE_TYPE = "Probe type is different from existing probe"
DIFF_ARG_TYPE = "Argument type or name is different from existing probe"
SAME_PROBE = "There is already the exact same probe event"
NON_UNIQ_SYMBOL = "The symbol is not unique"
# Later kernels' (6.12's trace_probe.h): BTF arguments, $arg* and the $comm type check.
NO_RETVAL = "This function returns 'void' type"
NOSUP_BTFARG = "BTF is not available or not supported"
NO_BTFARG = "This variable is not found at this probe point"
NO_BTF_ENTRY = "No BTF entry for this probe point"
NOFENTRY_ARGS = "$arg* can be used only on function entry or exit"
DOUBLE_ARGS = "$arg* can be used only once in the parameters"
ARGS_2LONG = "$arg* failed because the argument list is too long"
NOSUP_DAT_ARG = "Non pointer structure/union argument is not supported."
NO_PTR_STRCT = "This is not a pointer to union/structure."
NO_BTF_FIELD = "This field is not found."
BAD_BTF_TID = "Failed to get BTF type info."
BAD_HYPHEN = "Failed to parse single hyphen. Forgot '>'?"
BAD_TYPE4STR = "This type does not fit for string."
NEED_STRING_TYPE = "$comm and immediate-string only accepts string type"
# uprobe_events' own (trace_probe.h, the same in 6.1 and 6.12).
FILE_NOT_FOUND = "Failed to find the given file"
NO_REGULAR_FILE = "Not a regular file"
BAD_REFCNT = "Invalid reference counter offset"
REFCNT_OPEN_BRACE = "Reference counter brace is not closed"
BAD_REFCNT_SUFFIX = "Reference counter has wrong suffix"
BAD_UPROBE_OFFS = "Invalid uprobe offset"
BAD_FILE_OFFS = "Invalid file offset value"
SYM_ON_UPROBE = "Symbol is not available with uprobe"
# Logged from Linux 6.15 ("tracing: probe-events: Log error for exceeding the number of arguments");
# from 6.5 the kernel refuses with -E2BIG and logs nothing, before that it ignores the arguments after
# MAX_TRACE_ARGS.
TOO_MANY_ARGS = "Too many arguments are specified"

# --- qprobe's own texts: the kernel returns -EINVAL and logs nothing -------
NOT_A_PROBE = "Not a kprobe definition (expected p, r or -)"
NO_PROBE_POINT = "No probe point is specified"
UPROBE_SYNTAX = "This is an uprobe definition, not a kprobe one"
NOT_A_UPROBE = "Not a uprobe definition (expected p, r or - and PATH:OFFSET)"
BAD_DELETE = "Invalid delete command (expected -:[GRP/][EVENT])"
EMPTY_COMMAND = "Empty probe definition"
# trace_parse_run_command's pr_warn (kernel/trace/trace.c): a line of a write to kprobe_events must fit its
# WRITE_BUFSIZE (4096) buffer with its newline and NUL.  WRITE_BUFSIZE is a #define no kernel data holds;
# it has been 4096 since the command parser was shared (Linux 4.17, "tracing: Add trace_parse_run_command").
WRITE_BUFSIZE = 4096
LINE_TOO_LONG = f"Line length is too long: Should be less than {WRITE_BUFSIZE - 2}"
UNLOGGED = frozenset(
    {NOT_A_PROBE, NOT_A_UPROBE, NO_PROBE_POINT, UPROBE_SYNTAX, BAD_DELETE, EMPTY_COMMAND, LINE_TOO_LONG}
)

# --- limits (trace_probe.h, trace.h, trace_kprobe.c; x86_64 values) --------
MAX_TRACE_ARGS = 128
MAX_ARGSTR_LEN = 63
MAX_ARRAY_LEN = 64
MAX_ARG_NAME_LEN = 32
MAX_EVENT_NAME_LEN = 64
MAX_STRING_SIZE = 4096  # PATH_MAX, including the terminating NUL
FETCH_INSN_MAX = 16
KRETPROBE_MAXACTIVE_MAX = 4096
MAX_BTF_ARGS_LEN = 128  # the buffer $argN and $arg* are expanded into (trace_probe.h, Linux 6.5 on)
UINT_MAX = 0xFFFF_FFFF
KPROBE_EVENT_SYSTEM = "kprobes"
UPROBE_EVENT_SYSTEM = "uprobes"
