# Two commands set everything up on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test test-portable test-floor lint docs dist bench clean

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

# AdamW, Muon, NorMuon and AdaMuon equally tuned, 3 seeds each (docs/study.md): under an hour on 2 cores;
# interrupted, the same command continues it, keeping every finished run
.PHONY: study
study: $(STAMP)
	$(PY) examples/study.py --resume

# fp32 against bf16 optimizer state (state_dtype), Muon and AdamW at the study's tuned rates, 3 seeds of 300 steps
# (docs/study.md): about 12 minutes on one idle core; interrupted, the same command continues it
.PHONY: state-study
state-study: $(STAMP)
	$(PY) examples/state_study.py --resume

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

test: lint test-portable
	$(PY) -m pytest -q

# The numerics again without ATen's AVX kernels (ATEN_CPU_CAPABILITY=default, as on a CPU without AVX2),
# in a fresh inductor cache of its own: kernels compiled for this CPU's capability do not build there.
# The modules whose results depend on the CPU's kernels (Newton–Schulz, the transforms and presets, the
# reference, half precision, the documented tables), so that `make test`
# stays well inside CI's limit on 2 cores.
PORTABLE_TESTS := tests/test_newton_schulz.py tests/test_gram_newton_schulz.py tests/test_transforms.py \
	tests/test_presets.py tests/test_variants.py tests/test_reference.py tests/test_half_precision.py \
	tests/test_functional.py tests/test_adamw.py tests/test_docs.py muonfn

test-portable: $(STAMP)
	cache=$$(mktemp -d) && trap 'rm -rf "$$cache"' EXIT && \
		ATEN_CPU_CAPABILITY=default TORCHINDUCTOR_CACHE_DIR="$$cache" $(PY) -m pytest -q $(PORTABLE_TESTS)

# The core tests on the oldest versions pyproject.toml admits, in a venv of their own: .ci/floor.txt pins torch
# (its CPU build) and tensordict, FLOOR_PYTHON is requires-python's floor (tests/test_packaging.py checks both).
FLOOR_VENV ?= .venv-floor
FLOOR_PY := $(FLOOR_VENV)/bin/python
FLOOR_STAMP := $(FLOOR_VENV)/.installed-stamp
FLOOR_PYTHON := python3.11
FLOOR_TESTS := tests/test_newton_schulz.py tests/test_presets.py tests/test_transforms.py tests/test_optim.py \
	tests/test_functional.py tests/test_checkpoint.py muonfn

$(FLOOR_STAMP): pyproject.toml .ci/floor.txt
	$(FLOOR_PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_PY) -m pip install -q --upgrade pip
	# muonfn's own requirements resolve under the pins: they must admit the floor, and nothing can pull a CUDA torch
	$(FLOOR_PY) -m pip install -q -c .ci/floor.txt -e ".[testing]" pytest pytest-timeout
	touch $(FLOOR_STAMP)

test-floor: $(FLOOR_STAMP)
	$(FLOOR_PY) -m pytest -q $(FLOOR_TESTS)

# the API reference is generated from the docstrings; any warning fails the build
docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -q -b html docs site

# the sdist and the wheel a user installs, under dist/, checked as an index would check them
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --outdir dist .
	$(PY) -m twine check --strict dist/*

bench: $(STAMP)
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) $(FLOOR_VENV) dist site .pytest_cache .mypy_cache .ruff_cache .hypothesis
