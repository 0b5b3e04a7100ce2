"""pdserve api package."""
