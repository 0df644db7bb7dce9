# One entry point. `make test` and `make demo` create .venv themselves.
# On a machine without an NVIDIA GPU the CPU build of torch is installed first, pinned,
# so that no dependency drags in the multi-GB CUDA wheels, and the rest goes in through uv (the
# same versions as pip: 39 s instead of pip's 175 s on this machine, BENCHMARKS.md "Install";
# pip does it where uv cannot be installed or fails); with a GPU, pip and the `gpu` extra.
VENV      ?= .venv
PY        := $(VENV)/bin/python
TORCH_CPU ?= torch==2.13.0
UV        ?= uv==0.13.9
# on a GPU machine: the torch the xformers wheel was built for (pyproject's `gpu` extra), from
# PyTorch's index for its CUDA (README, "GPU install")
TORCH_GPU_INDEX ?= https://download.pytorch.org/whl/cu128
STAMP     := $(VENV)/.installed
# the venv's tools first: should DeepSpeed JIT-build an op, it uses whichever ninja is on PATH, and
# two ninja versions sharing its build cache rebuild it (30-100 s) each time they alternate
RUN       := PATH=$(CURDIR)/$(VENV)/bin:$$PATH

.PHONY: install test demo lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q "$(TORCH_CPU)" && \
		{ $(PY) -m pip install -q "$(UV)" || true; }; fi
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install -q -e '.[test,gpu]' --extra-index-url $(TORCH_GPU_INDEX); \
	else { test -x $(VENV)/bin/uv && \
		$(VENV)/bin/uv pip install -q --python $(PY) --compile-bytecode -e '.[test]'; } \
		|| $(PY) -m pip install -q -e '.[test]'; fi
	touch $@

# two pytest workers, a test file each at a time (its module fixtures run once), the longest files
# first (tests/conftest.py): the suite's in-process tests use one thread, and a launcher test's
# ranks leave a core idle while they start
TEST_WORKERS ?= 2
test: $(STAMP)
	$(RUN) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		--durations=20 tests

demo: $(STAMP)
	$(RUN) $(PY) -m mpp demo

lint: $(STAMP)
	$(VENV)/bin/ruff check mpp pretrain downstream tests benchmarks
	$(VENV)/bin/ruff format --check mpp pretrain downstream tests benchmarks

clean:
	rm -rf $(VENV) runs .cache
