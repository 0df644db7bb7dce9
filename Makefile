# One entry point. `make test` and `make demo` create .venv themselves.
# On a machine without an NVIDIA GPU the CPU build of torch is installed first, pinned,
# so that no dependency drags in the multi-GB CUDA wheels.
VENV      ?= .venv
PY        := $(VENV)/bin/python
TORCH_CPU ?= torch==2.13.0
STAMP     := $(VENV)/.installed

.PHONY: install test demo lint clean
# the demo's ranks: one per GPU, or 2 CPU ranks (gloo) on a machine without one
DEMO_RANKS ?= $(shell n=$$(nvidia-smi -L 2>/dev/null | wc -l); [ "$$n" -gt 0 ] && echo $$n || echo 2)

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q "$(TORCH_CPU)"; fi
	$(PY) -m pip install -q -e '.[test]'
	touch $@

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH deepspeed --num_gpus $(DEMO_RANKS) pretrain/run.py --config mpp_demo

lint: $(STAMP)
	$(VENV)/bin/ruff check mpp pretrain downstream tests

clean:
	rm -rf $(VENV) runs .cache
