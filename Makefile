# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# GPU users: make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tlt-installed

.PHONY: venv demo test bench clean

venv: $(STAMP)

# torch goes in first, from TORCH_SPEC, so the unpinned range in pyproject.toml installs nothing more.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[dev,bench,data,tensorboard,ray]"
	touch $(STAMP)

# The main job on its embedded default: a few GRPO steps of SmolLM2-135M-Instruct on the built-in task (~5 min).
# --overwrite: each `make demo` starts runs/demo afresh (a fresh `tlt train` refuses a directory holding a run).
demo: $(STAMP)
	$(VENV)/bin/tlt train run.out_dir=runs/demo --overwrite

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/rollout_throughput.py --json benchmarks/results/rollout_throughput.json

clean:
	rm -rf $(VENV) build src/*.egg-info
