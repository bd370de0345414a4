# rpcmp: every target installs what it needs into a project venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.rpcmp-installed
PACKAGES := torch==2.14.1 torchvision==0.29.1 -e '.[test]'

.PHONY: install bytecode demo test unit bench bench-net gpu-check lint clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch and torchvision pinned (other builds download GBs or fail). uv fetches and unpacks the wheels side by
	# side (torch's GBs of CUDA libraries among them) and compiles their modules (as pip does: where
	# PYTHONDONTWRITEBYTECODE is set, nothing else would, and every process would compile torch on import). On 2
	# cores with empty caches: 56 s where pip took 110 s (64 s beside a busy core), 133 s where pip took 225 s
	# from a slower registry. pip installs them where uv cannot.
	$(PY) -m pip install -q uv && $(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) $(PACKAGES) \
		|| $(PY) -m pip install -q $(PACKAGES)
	touch $@

# The project's own modules compiled once, where a fresh process reads them: with PYTHONDONTWRITEBYTECODE
# set (as in many CI images) nothing writes __pycache__, and every process the suite or a run starts
# compiled rpcmp from source on import (0.7-0.9 s of each start of a process that imports it, on 2 cores).
# Only what changed since is compiled again.
bytecode: install
	$(PY) -m compileall -q rpcmp tests examples benchmarks > /dev/null

demo: install bytecode
	$(VENV)/bin/rpcmp run examples/unet_split/job.py --local 3 --checkpoint-dir runs/unet
	$(VENV)/bin/rpcmp predict examples/unet_split/job.py -c runs/unet --out runs/unet/predictions

# Three pytest workers: most tests wait on processes they started (start-up, RPC, a hang timeout, a
# restart), so three at a time finish sooner even on two cores. `--dist loadfile` runs each test file
# on one worker, start to end: a module fixture (one run that several tests check) is computed once,
# and the network-namespace tests (one file) build one cluster at a time.
test: install bytecode
	$(PY) -m pytest -n 3 --dist loadfile --no-loadscope-reorder

# The in-process tests alone (no launched processes; tests/unit mirrors rpcmp/ package by package),
# without the ones that trace a real model (marked `model`, run by `make test`), on every core: about a minute.
unit: install bytecode
	$(PY) -m pytest -q -n auto -m "not model" tests/unit rpcmp

bench: install bytecode
	$(PY) benchmarks/bench.py
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/grid.py
	$(PY) benchmarks/recovery.py
	$(PY) benchmarks/rebalance.py

# The CUDA paths and their timings on this machine's GPU; says "no CUDA device: skipped" without one.
# The split Unet over three network-namespace nodes with shaped links (root: ip netns, tc).
bench-net: install
	$(PY) benchmarks/network.py

gpu-check: install
	$(PY) tests/gpu/check.py

lint: install
	$(PY) -m pip install -q ruff
	$(VENV)/bin/ruff check rpcmp tests examples benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
	find rpcmp tests examples benchmarks -name __pycache__ -prune -exec rm -rf {} +
