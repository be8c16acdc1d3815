# Two commands for a newcomer: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.openamct-installed
PIP     = $(PY) -m pip install -q -c .ci/constraints.txt
PYTEST_ARGS ?=

.PHONY: demo test test-fast proto lint bench clean

# The vision zoos' torchvision and timm go into $(VENV)/zoo-site, which only tests/zoo puts on
# sys.path: PyPI's torchvision is a CUDA build whose import fails against the CPU torch, and
# transformers imports torchvision wherever it is installed (tests/zoo/torchvision_ops.py).
# --no-deps: pip must never bring another torch.
$(STAMP): pyproject.toml .ci/constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev,demo,examples]'
	$(PIP) --no-deps --upgrade --target $(VENV)/zoo-site torchvision==0.28.0 timm==1.0.31
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/openamct demo --out demo-out

# The zoo's runs are single-threaded and independent: two pytest-xdist workers, one per core.
test: $(STAMP)
	$(PY) -m pytest -q --ignore=tests/zoo $(PYTEST_ARGS)
	$(PY) -m pytest -q -n 2 tests/zoo $(PYTEST_ARGS)

# Local loop: everything but the end-to-end tests marked slow.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m 'not slow' $(PYTEST_ARGS)

# Regenerate the checked-in protobuf code from the .proto files.
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iopenamct/config --python_out=openamct/config openamct/config/retrain_config.proto
	$(PY) -m grpc_tools.protoc -Iopenamct/config --python_out=openamct/config openamct/config/auto_channel_prune_config.proto
	$(PY) -m grpc_tools.protoc -Iopenamct/distill --python_out=openamct/distill openamct/distill/distill_config.proto
	$(PY) -m grpc_tools.protoc -Iopenamct/record --python_out=openamct/record openamct/record/scale_offset_record.proto

lint: $(STAMP)
	$(VENV)/bin/ruff check openamct tests benchmarks examples

bench: $(STAMP)
	for b in benchmarks/*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) demo-out build *.egg-info
