"""Benchmarks and the engine harness, run from a checkout (`python -m bench.X`); not in the installed wheel.

=======================  =========================================================================
``engine_process``       the harness: a `pdserve serve` subprocess (free port, readiness, SIGTERM, shm sweep),
                         used by every engine benchmark and by the e2e tests
``serving``              the OpenAI-API load generator the engine benchmarks drive
``anchors``              pdserve beside llama.cpp's llama-server and HF generate (build_llama_server.sh)
``engine``, ``colocated``, ``n``, ``prefill``, ``prefix_cache``, ``crossturn``, ``multinode``, ``kv_network``,
``ledger``, ``kquants``: engine-level comparisons, each against a baseline run beside it
``ipc``, ``gpu``, ``grammar``, ``quality``, ``decode_bandwidth``, ``prefill_forward``, ``detection``,
``incidents``: one layer in process (queues and KV copy, kernels, sampler masks, weight quality, ...)
``netns``                two network namespaces as two hosts (bench.multinode, tests/multinode)
=======================  =========================================================================

Each module's docstring says what it measures and against what; docs/performance.md keeps the results.
"""
