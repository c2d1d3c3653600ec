"""kprobe_events definitions on a Target: one language for the API, the CLI and the shell.

``target.add_event("p:myread vfs_read count=%dx:u64")`` parses the definition
exactly as the kernel's kprobe_events would, registers a kprobe (or a
kretprobe for ``r``/``%return``) whose handler evaluates the fetch arguments
against the stopped vCPU, and records one ``EventHit`` per hit, printable as
ftrace's trace prints it.  Nothing is written into the guest's tracing
directory: the guest needs no CONFIG_KPROBE_EVENTS.

The package, top to bottom:

- ``define``: add_event, add_events (a glob), remove_events, on an
  ``EventRegistry`` (the narrow view of the target events receive);
- ``kprobe``: the kprobe kind, ``KprobeEvent`` and the ``KprobeBackend``
  through which it holds its probes (a second probe kind sits beside it);
- ``event``: ``TraceEvent``, one definition armed, whatever its probe kind:
  its hits, counts and filter;
- ``inguest``: what an optimized probe records, filters or counts in the guest;
- ``fold``: where a map over events is folded (guest RAM, the probes' counts, the rings), for every front end;
- ``context``, ``hit``: the fetch context of one hit and the hit itself;
- ``registry``: the target's view at a hit (``EventHost``);
- ``funcs``: which functions can be probed (also ``qprobe funcs``);
- ``modules``: module events re-registered as their module loads;
- ``timeline``: hits handed on in the guest's order;
- ``samples``: a ring handler's batches (``Target.ring_buffer``), off the record rings.
"""

from qprobe.events.define import MAX_WILDCARD, EventRegistry, Wildcard, add_event, add_events, remove_events
from qprobe.events.event import InOrder, TraceEvent, event_filter
from qprobe.events.fold import GuestMaps, fold_path
from qprobe.events.hit import EventHit
from qprobe.events.inguest import guest_filter, guest_key, in_guest
from qprobe.events.kprobe import KprobeBackend, KprobeEvent, entry_args
from qprobe.events.samples import Sample, SampleCb, Samples

__all__ = [
    "MAX_WILDCARD",
    "EventHit",
    "EventRegistry",
    "GuestMaps",
    "InOrder",
    "KprobeBackend",
    "KprobeEvent",
    "Sample",
    "SampleCb",
    "Samples",
    "TraceEvent",
    "Wildcard",
    "add_event",
    "add_events",
    "entry_args",
    "event_filter",
    "fold_path",
    "guest_filter",
    "guest_key",
    "in_guest",
    "remove_events",
]
