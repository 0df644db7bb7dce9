# One entry point. `make test` and `make demo` create .venv themselves.
# On a machine without an NVIDIA GPU the CPU build of torch is installed first, pinned,
# so that no dependency drags in the multi-GB CUDA wheels.
VENV      ?= .venv
PY        := $(VENV)/bin/python
TORCH_CPU ?= torch==2.13.0
STAMP     := $(VENV)/.installed

.PHONY: install test demo lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q "$(TORCH_CPU)"; fi
	$(PY) -m pip install -q -e '.[test]'
	touch $@

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(PY) -m mpp.demo

lint: $(STAMP)
	$(VENV)/bin/ruff check mpp pretrain downstream tests

clean:
	rm -rf $(VENV) runs .cache
