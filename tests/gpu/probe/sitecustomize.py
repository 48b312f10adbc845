"""Probes of the PS hooks' cost on a GPU (tests/gpu/ps_hooks.sh), each off unless its
variable is set: SWITCH_S, the GIL switch interval (sys.setswitchinterval; CPython's
default 5 ms); POLLED=1, the PS stage threads' copy waits (methods/ps/node.py `_finish`)
poll the event as they did before 2026-11-26 instead of waiting in CUDA."""
import importlib.abc
import importlib.machinery
import os
import sys

if os.environ.get("SWITCH_S"):
    sys.setswitchinterval(float(os.environ["SWITCH_S"]))


def _polled_finish(event):
    from methods.base import poll_until

    if event is not None:
        poll_until(event.query, timeout_s=300, what="the copy")


class _Patch(importlib.abc.MetaPathFinder):
    """Once methods.ps.node (or .scatter) is loaded, its `_finish` polls instead."""

    def find_spec(self, name, path, target=None):
        if name not in ("methods.ps.node", "methods.ps.scatter"):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module._finish = _polled_finish
        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("POLLED"):
    sys.meta_path.insert(0, _Patch())
