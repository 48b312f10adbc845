"""Probes of the PS hooks' cost on a GPU (tests/gpu/ps_hooks.sh), each off unless its
variable is set: SWITCH_S, the GIL switch interval (sys.setswitchinterval; CPython's
default 5 ms); NOPOLL=1, the PS pipeline's copy waits (methods/ps/node.py `_finish`) block
in event.synchronize(), which releases the GIL, instead of polling the event."""
import importlib.abc
import importlib.machinery
import os
import sys

if os.environ.get("SWITCH_S"):
    sys.setswitchinterval(float(os.environ["SWITCH_S"]))


def _blocking_finish(event, *, timeout_s, what):
    if event is not None:
        event.synchronize()


class _Patch(importlib.abc.MetaPathFinder):
    """Once methods.ps.node is loaded, its `_finish` (and scatter's copy) block instead."""

    def find_spec(self, name, path, target=None):
        if name not in ("methods.ps.node", "methods.ps.scatter"):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module):
            run(module)
            module._finish = _blocking_finish
        loader.exec_module = exec_module
        return spec


if os.environ.get("NOPOLL"):
    sys.meta_path.insert(0, _Patch())
