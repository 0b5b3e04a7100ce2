"""pdserve gpu package."""
