"""pdserve actors package."""
