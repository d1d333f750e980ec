# Two commands set everything up on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test test-portable lint docs bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch (a bare `torch` requirement would pull a multi-GB CUDA build)
	$(PY) -m pip install -q torch==2.13.0
	# the constraint keeps that torch: no package may replace it with another build
	$(PY) -m pip install -q -c .ci/torch-cpu.txt -e ".[dev,demo,docs,hf,peers]"
	# timm.optim.muon imports no torchvision, whose wheel expects a CUDA torch: timm without its requirements
	# (its others, pyyaml, huggingface_hub and safetensors, come with the peers extra)
	$(PY) -m pip install -q -c .ci/torch-cpu.txt --no-deps timm
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

test: lint test-portable
	$(PY) -m pytest -q

# The suite again without ATen's AVX kernels (ATEN_CPU_CAPABILITY=default, as on a CPU without AVX2),
# in a fresh inductor cache of its own: kernels compiled for this CPU's capability do not build there.
# It leaves out the modules that mostly start processes (examples, torchrun launches, the benchmark
# smoke run), so that `make test` stays well inside CI's limit on 2 cores.
PORTABLE_SKIP := tests/test_examples.py tests/test_distributed_torch.py tests/test_benchmarks_smoke.py

test-portable: $(STAMP)
	cache=$$(mktemp -d) && trap 'rm -rf "$$cache"' EXIT && \
		ATEN_CPU_CAPABILITY=default TORCHINDUCTOR_CACHE_DIR="$$cache" $(PY) -m pytest -q $(PORTABLE_SKIP:%=--ignore=%)

# the API reference is generated from the docstrings; any warning fails the build
docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -q -b html docs site

bench: $(STAMP)
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) site .pytest_cache .mypy_cache .ruff_cache .hypothesis
