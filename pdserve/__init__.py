"""pdserve pdserve package."""
