"""pdserve ipc package."""
