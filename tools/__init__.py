"""pdserve tools package."""
