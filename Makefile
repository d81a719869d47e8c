# The README's commands. `make train` and `make test` do all the set-up on a fresh machine.
# The interpreter: an active venv/conda env's, else the project's .venv where python3 is the
# system's (PEP 668), else python3 (scripts/python_env.sh). `make PYTHON=...` overrides it.
ifeq ($(origin PYTHON), undefined)
PYTHON := $(shell sh scripts/python_env.sh)
endif
PIP_INSTALL = $(PYTHON) -m pip install --quiet --disable-pip-version-check -c constraints-cpu.txt

.PHONY: setup train test test-fast test-repeat lint bench clean docs docs-serve

# Where the interpreter already has a setuptools that builds editable wheels by itself
# (>= 70.1), the project is built with it rather than in a fresh isolated environment (6 s).
NO_ISOLATION = $$($(PYTHON) -c "import setuptools as s, sys; sys.exit(tuple(map(int, s.__version__.split('.')[:2])) < (70, 1))" 2>/dev/null && echo --no-build-isolation)
setup:
	@sh scripts/python_env.sh create $(PYTHON)
	$(PIP_INSTALL) $(NO_ISOLATION) -e '.[dev,sklearn,hf,tensorboard,mlflow,adapter,fp8,docs,ft]'

train: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PYTHON) -m trainer.train $(ARGS)

# Every test: what CI runs (.ci/run). See docs/testing.md. Two pytest-xdist workers when it is
# installed (the dev extra): a test file stays on one worker (its module fixtures run once);
# the suite is CPU-bound and the multi-rank jobs overlap the one-process tests. Bytecode is
# cached even where the environment says not to (PYTHONDONTWRITEBYTECODE=1): the suite starts
# hundreds of fresh interpreters, each would compile the project's sources again.
XDIST = $$($(PYTHON) -c "import xdist" 2>/dev/null && echo "-n 2 --dist loadfile")
PYTEST = OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE= $(PYTHON) -m pytest -q
test: setup
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTEST) $(XDIST) --durations=15 $(PYTEST_ARGS)

# The edit loop (< 3 min): config, unit and one-process numerics; no launched process.
# Two pytest-xdist workers when it is installed (the dev extra): measured faster on 2 cores.
test-fast:
	$(PYTEST) -m "not multiproc and not launches and not slow" $(XDIST) $(PYTEST_ARGS)

# Hunting flakes: the multi-rank tier (or TESTS="tests/test_ranks.py ...") N times in a row,
# stopping at the first failure. See docs/testing.md.
N ?= 5
TESTS ?= -m multiproc
test-repeat:
	@for i in $$(seq $(N)); do \
		echo "== test-repeat: run $$i of $(N)"; \
		$(PYTEST) -p no:cacheprovider $(TESTS) $(PYTEST_ARGS) || exit 1; \
	done; echo "== test-repeat: $(N) runs passed"

# The documentation site (mkdocs.yml, docs/): built with --strict (a broken link or anchor, a
# missing page, a page left out of the navigation fail) into site/ (git-ignored), with no
# network; open site/index.html. The config-key reference is generated from the schema.
# docs-serve rebuilds on every edit and serves it on http://127.0.0.1:8000.
MKDOCS = NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs
docs: setup
	$(MKDOCS) build --strict

docs-serve: setup
	$(MKDOCS) serve

lint:
	$(PYTHON) -m ruff check . && $(PYTHON) -m ruff format --check .

clean:
	rm -rf outputs .pytest_cache site
