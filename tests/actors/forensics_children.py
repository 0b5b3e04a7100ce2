"""Children for tests/actors/test_forensics.py (spawned: importable by name)."""
from __future__ import annotations

import time


def stuck_in_a_call(engine_id: str, name: str, ready, armed: bool = True) -> None:
    """Arm the stacks dump (or not), say so, then sit in one function for a minute (a stuck loop's call)."""
    if armed:
        from actors.forensics import arm

        arm(engine_id, name)
    waiting_on_a_transfer_that_never_ends(60.0, ready)


def waiting_on_a_transfer_that_never_ends(seconds: float, ready) -> None:
    ready.set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)
