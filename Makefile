# zero_ext: `make test` sets up what is missing and runs the whole suite; `make demo` trains a small GPT.
PYTHON ?= python3
PYTEST_ARGS ?=

.PHONY: setup test build clean demo

setup:
	PYTHON=$(PYTHON) bash scripts/setup.sh

# pytest exits 5 when it collected no test: make fails on it like on any failure.
test: setup
	$(PYTHON) -m pytest -p no:cacheprovider $(PYTEST_ARGS)

# A small GPT trained on 2 CPU processes with gloo (torchrun); options: make demo DEMO_ARGS="--stage 1 --bf16".
demo: setup
	OMP_NUM_THREADS=1 $(PYTHON) -m torch.distributed.run --standalone --nproc_per_node 2 demo/train_gpt.py $(DEMO_ARGS)

build:
	$(PYTHON) -m pip install --no-build-isolation --no-deps -e .

clean:
	rm -rf build *.egg-info zero_ext/*.so .deps-stamp
