"""The pytest plugin's parts, one concept a module; ``qprobe.pytest_plugin`` is the plugin pytest registers.

pytest finds hooks and fixtures only as attributes of a registered plugin module, so
``qprobe.pytest_plugin`` imports each of them from here; this package registers nothing itself.

    state    what the parts keep on pytest's config and items (the stash), and the record of each VM
    options  the command-line options, the markers' declarations, the images tests run on, their parametrization
    markers  the ``qprobe_needs_*`` markers that skip a test on an image that lacks what it needs
    vm       the fixtures that boot a VM and say what it was booted with
    reset    ``QprobeReset`` and the ``qprobe_reset`` fixture: what happens around each test on a VM
    reports  a failing test's report, ``--qprobe-no-skip``, and the terminal summary

The names with a leading underscore are the plugin's own, not for tests: they are shared among these
modules only.
"""
