# zero_ext: `make test` sets up what is missing and runs the whole suite; `make demo` (with the engine).
PYTHON ?= python3
PYTEST_ARGS ?=

.PHONY: setup test build clean

setup:
	PYTHON=$(PYTHON) bash scripts/setup.sh

# pytest exits 5 when it collected no test: make fails on it like on any failure.
test: setup
	$(PYTHON) -m pytest -p no:cacheprovider $(PYTEST_ARGS)

build:
	$(PYTHON) -m pip install --no-build-isolation --no-deps -e .

clean:
	rm -rf build *.egg-info zero_ext/*.so .deps-stamp
