"""pdserve ipc package: shared-memory transport between the engine's processes.

Modules (import them directly; nothing is imported here, so children stay light):
- ``naming``        segment names ``/pdserve_{engine_id}_{what}``, leak listing, ``unlink_all``
- ``shm_queue``     ``ShmQueue``: bounded queue of orjson frames (shm ring + semaphores), mpmc or a
                    mutex-free spsc mode for one producer and one consumer
- ``state_table``   ``RequestState``, ``ALLOWED`` and ``StateTable``: the request lifecycle in shm
- ``actor_table``   ``ActorTable``: every per-actor fact (process, heartbeat, status, health, KV and own gauges)
- ``engine_status`` ``EngineStatus``: engine-wide watchdog counters, stuck-gauge flags, the drain flag
- ``manifest``      ``Manifest``: the engine's layout and effective config as JSON, for tools/inspect
- ``kv_pool``       ``KVPool`` / ``BlockAllocator``: one actor's paged KV cache and its block allocator
- ``kv_transport``  ``KVTransport``, ``CpuShmTransport``, ``make_transport``: the KV handoff
- ``kv_copy``       ``copy_blocks``: cpu-shm's compiled copy loop (imports numba; only that transport uses it)
- ``_shm``          ``ShmSegment``, the base of every shm object above (create/attach/close/unlink, magic and
                    layout version); semaphore waits; the dead-holder-safe lock
"""
