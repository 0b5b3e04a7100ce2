"""pytest plugin for llama.cpp's server suite run against pdserve (tools/llama_suite.sh): the suite's session
fixture ``load_server_presets`` starts and stops every preset once (``ServerPreset.load_all``) so that each
model is downloaded before the tests run offline. The shim (tools/llama_server_shim.py) downloads nothing, so
that warm-up is skipped here: ten engine starts per module on a 2-core machine, for no test."""
from __future__ import annotations

import sys


def pytest_sessionstart(session) -> None:
    utils = sys.modules.get("utils")
    if utils is None:
        import utils   # the suite's utils.py, on sys.path through its rootdir conftest
    utils.ServerPreset.load_all = staticmethod(lambda: None)
