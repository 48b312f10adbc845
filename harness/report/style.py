"""How a method looks and sorts: the study's method order, a fixed color per method and
hatching for a method run on another engine (`wfbp_a2a@horovod`) or with other settings
(`bsp_a2a [optimizer.name=sgd]`, report/data.py `series`)."""

from __future__ import annotations

import zlib
from collections.abc import Iterable

from matplotlib import colormaps

METHOD_ORDER = (
    "bsp_ps bsp_a2a wfbp_ps wfbp_a2a mgwfbp bytescheduler_ps bytescheduler_a2a priority_ps "
    "ddp".split()
)
# tab20 index per method: a PS/A2A pair shares a hue (PS light, A2A dark); ddp is gray.
_TAB20 = dict(zip(METHOD_ORDER, [1, 0, 3, 2, 4, 7, 6, 5, 14]))
_TAB20_SPARE = [8, 10, 12, 16, 18, 9, 11, 13, 17, 19]


def base_method(series: str) -> str:
    """The method of a series: `wfbp_a2a@horovod [sync_each_step=device]` -> wfbp_a2a."""
    return series.partition(" [")[0].partition("@")[0]


def method_order(methods: Iterable[str]) -> list[str]:
    """The study's method order, then ddp, then any other names alphabetically; a method on
    another engine or with other settings right after the method itself."""
    names = set(methods)
    native = {base_method(m) for m in names}
    order = [m for m in METHOD_ORDER if m in native] + sorted(native - set(METHOD_ORDER))
    return [n for m in order for n in sorted(names) if base_method(n) == m]


def method_hatch(method: str) -> str | None:
    """Bars in the method's color, hatched on another engine (xx) and with other settings
    (//, both: xx//)."""
    return ("xx" if "@" in method else "") + ("//" if " [" in method else "") or None


def method_color(method: str) -> tuple[float, ...]:
    """A fixed color per method name (the same in every figure; on any engine, with any
    settings)."""
    method = base_method(method)
    index = _TAB20.get(method)
    if index is None:
        index = _TAB20_SPARE[zlib.crc32(method.encode()) % len(_TAB20_SPARE)]
    return colormaps["tab20"](index)

