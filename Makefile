# qprobe: `make run` boots the default kernel with probes; `make test` runs every test.
# Both install what they need: Debian packages with apt-get, Python packages into .venv.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
DEBS   := qemu-system-x86 busybox-static cpio gdb e2fsprogs gcc libc6-dev tmux

.PHONY: all setup system-deps venv image run test test-matrix test-guest-ftrace unit vm lint bench soak clean

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

run: image
	$(BIN)/qprobe demo

unit: venv
	$(BIN)/pytest -q tests/unit

vm: image
	$(BIN)/pytest -q tests/vm

test: image
	$(BIN)/ruff check qprobe tests examples scripts
	$(BIN)/ruff format --check qprobe tests examples scripts
	$(BIN)/pytest -q tests examples

# The VM tests and the examples on each kernel (debian-rt is fetched on first use).
test-matrix: image
	$(BIN)/pytest -q --qprobe-image debian-cloud --qprobe-image debian-rt tests/vm examples

# The oracle tests that enable the guest's own ftrace events beside qprobe's probes (see docs/reliability.md).
test-guest-ftrace: image
	QPROBE_GUEST_FTRACE=1 $(BIN)/pytest -q tests/vm/test_oracle.py

# The soak of tests/vm/test_soak.py for 10 minutes instead of make test's 60 s.
soak: image
	QPROBE_SOAK_SECONDS=600 $(BIN)/pytest -q -s tests/vm/test_soak.py

bench: image
	$(BIN)/qprobe bench

lint: venv
	$(BIN)/ruff check qprobe tests examples scripts
	$(BIN)/ruff format --check qprobe tests examples scripts

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
