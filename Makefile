# qprobe: `make run` boots the default kernel with probes; `make test` runs every test.
# Both install what they need: Debian packages with apt-get, Python packages into .venv.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
DEBS   := qemu-system-x86 busybox-static cpio gdb e2fsprogs gcc libc6-dev tmux \
          make flex bison bc libelf-dev xz-utils binutils \
          qemu-system-arm gcc-aarch64-linux-gnu libc6-dev-arm64-cross
# The tests every image runs: kprobes, kretprobes, optimized and in-guest probes, events,
# stack traces, typed data, recovery, the instruction-boundary sweep, probes at an ENDBR entry,
# uprobes (the host's, and the guest kernel's own counting and recording for qprobe: its API changed in 6.12),
# a guest command's output kept apart from the kernel's log, probes on a module's functions (its init
# text is mem[MOD_INIT_TEXT] from 6.4, init_layout before),
# and the guest kernel's own kprobes as the oracle (verdicts on kprobe_events definitions, and
# hits and counts with the guest's own events enabled beside qprobe's, in a VM whose vCPUs share
# one TCG thread: see docs/reliability.md); and what `trace --run` counts of a command (applets,
# builtins, pipelines, programs, from the fork of its process), whatever the kernel.
VM_CORE := tests/vm/test_kprobes.py tests/vm/test_kretprobes.py tests/vm/test_optimized.py \
           tests/vm/test_events.py tests/vm/test_stacktrace.py tests/vm/test_drgn.py \
           tests/vm/test_typed.py tests/vm/test_recovery.py tests/vm/test_kprobes_sweep.py tests/vm/test_ibt.py \
           tests/vm/test_oracle.py tests/vm/test_guest_shell.py tests/vm/test_guest_programs.py \
           tests/vm/test_uprobes.py tests/vm/test_uprobe_language.py tests/vm/test_uprobe_frontends.py \
           tests/vm/test_uprobe_lifecycle.py tests/vm/test_uprobe_guest_view.py tests/vm/test_uprobe_ifunc.py \
           tests/vm/test_uprobe_inguest.py tests/vm/test_uprobe_inguest_mttcg.py \
           tests/vm/test_boot_probes.py tests/vm/test_boot_frontends.py tests/vm/test_attach_boot.py \
           tests/vm/test_modules.py \
           tests/vm/test_cli_frontend.py::test_run_counts_the_command_from_its_fork_applets_builtins_pipelines_and_programs
# debian-cloud-6.12: IBT, return and call-depth thunks, ORC; minimal-6.12: built here from
# linux-source-6.12 (scripts/build-minimal-kernel.sh, 3.5-7 min on 2 cores), no kprobes, no ftrace.
IMAGES_612 := debian-cloud-6.12 minimal-6.12
# arm64 guests under qemu-system-aarch64 (Debian's cloud-arm64 kernels): the arm64 tests, each image a stage.
IMAGES_ARM64 := debian-cloud-arm64 debian-cloud-arm64-6.12
VM_ARM64 := tests/vm/test_arm64.py
MATRIX := debian-cloud debian-rt debian-cloud-6.12 debian-rt-6.12 minimal-6.12

.PHONY: all setup system-deps venv image images-6.12 run test test-612 test-matrix unit vm lint bench soak clean

all: setup

setup: system-deps venv

# Install only what is missing, so repeated runs cost nothing.
system-deps:
	@missing=$$(for p in $(DEBS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages: $$missing"; \
		$(SUDO) apt-get update -q && $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	fi

venv: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

image: setup
	$(BIN)/qprobe images --fetch debian-cloud

images-6.12: setup
	for i in $(IMAGES_612); do $(BIN)/qprobe images --fetch $$i || exit 1; done

run: image
	$(BIN)/qprobe demo

unit: venv
	$(BIN)/pytest -q tests/unit

vm: image
	$(BIN)/pytest -q tests/vm

# Every test on debian-cloud, the examples on the buildroot-style images, then the VM core on
# debian-cloud-6.12 and on minimal-6.12, fetched and built in the background meanwhile; a table of the stages' times and counts at the end.
test: image
	sh scripts/test-stages.sh $(BIN) "$(VM_CORE)" "$(IMAGES_612)" "$(VM_ARM64)" "$(IMAGES_ARM64)"

# The VM core on both 6.12 kernels.
test-612: images-6.12
	$(BIN)/pytest -q $(foreach i,$(IMAGES_612),--qprobe-image $(i)) $(VM_CORE)

# The VM tests and the examples on all five kernels. PYTEST_ARGS='-n 4' spreads the modules
# over pytest-xdist workers, one VM each (add '--dist loadscope' to keep a module on one worker).
test-matrix: image images-6.12
	for i in $(MATRIX); do $(BIN)/qprobe images --fetch $$i || exit 1; done
	$(BIN)/pytest -q $(PYTEST_ARGS) $(foreach i,$(MATRIX),--qprobe-image $(i)) tests/vm examples

# The soak of tests/vm/test_soak.py for 10 minutes instead of make test's 60 s.
soak: image
	QPROBE_SOAK_SECONDS=600 $(BIN)/pytest -q -s tests/vm/test_soak.py

bench: image
	$(BIN)/qprobe bench

# ruff, then mypy strict on the whole qprobe package (pyproject.toml): it fails, for one, when an
# architecture stops implementing the Arch protocol (qprobe/arch/select.py).
lint: venv
	$(BIN)/ruff check qprobe tests examples scripts
	$(BIN)/ruff format --check qprobe tests examples scripts
	$(BIN)/mypy

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .mypy_cache
