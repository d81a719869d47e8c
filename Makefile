# The README's commands. `make train` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
PIP_INSTALL = $(PYTHON) -m pip install --quiet --disable-pip-version-check -c constraints-cpu.txt

.PHONY: setup train test test-fast lint bench clean

setup:
	$(PIP_INSTALL) -e '.[dev,sklearn,hf,tensorboard,mlflow]'

train: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PYTHON) -m trainer.train $(ARGS)

# Every test: what CI runs (.ci/run). See docs/testing.md.
test: setup
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest -q $(PYTEST_ARGS)

# The edit loop (< 3 min): config, unit and one-process numerics; no launched process.
# Two pytest-xdist workers when it is installed (the dev extra): measured faster on 2 cores.
test-fast:
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest -q -m "not multiproc and not launches and not slow" \
		$$($(PYTHON) -c "import xdist" 2>/dev/null && echo "-n 2") $(PYTEST_ARGS)

lint:
	$(PYTHON) -m ruff check . && $(PYTHON) -m ruff format --check .

clean:
	rm -rf outputs .pytest_cache
