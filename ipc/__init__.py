"""pdserve ipc package: shared-memory transport between the engine's processes.

Modules (import them directly; nothing is imported here, so children stay light):
- ``naming``       segment names ``/pdserve_{engine_id}_{what}``, leak listing, ``unlink_all``
- ``shm_queue``    ``ShmQueue``: bounded MPMC queue of orjson frames (shm ring + semaphores)
- ``state_table``  ``RequestState``, ``ALLOWED`` and ``StateTable``: the request lifecycle in shm
- ``actor_table``  ``ActorTable``: per-actor heartbeat, status and KV gauges
- ``kv_pool``      ``KVPool`` / ``BlockAllocator``: one actor's paged KV cache and its block allocator
- ``kv_transport`` ``KVTransport``, ``CpuShmTransport``, ``make_transport``: the KV handoff
- ``_shm``         shared helpers (segment create/attach, semaphore waits, the dead-holder-safe lock)
"""
