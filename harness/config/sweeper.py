"""The sweeper of conf/hydra/sweeper/union.yaml: a sweep that is a union of products,
`params` (as Hydra's basic sweeper) plus one more product per entry of `extra`.
`config.sweep` runs the same union for harness.submit and harness.simulate; this class
gives Hydra's own multirun (`python -m harness.run -m ... hydra/launcher=...`) the same
jobs (plain `harness.run` expands the main product only: `config.expand`)."""

from __future__ import annotations

try:  # Hydra's basic sweeper, plus the extra products of `hydra.sweeper.extra`
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
except ImportError:  # pragma: no cover - Hydra always ships it
    BasicSweeper = object  # type: ignore[assignment,misc]


class UnionSweeper(BasicSweeper):
    """Hydra sweeper of conf/hydra/sweeper/union.yaml: the basic product of `params`,
    then one more product per `extra` entry (keys on the command line win)."""

    def __init__(self, max_batch_size: int | None = None, params: dict | None = None,
                 extra: list | None = None) -> None:
        super().__init__(max_batch_size=max_batch_size, params=params)
        self.extra = [dict(e) for e in (extra or [])]

    def sweep(self, arguments: list[str]):
        returns = super().sweep(arguments)
        given = {a.split("=", 1)[0].lstrip("+~") for a in arguments}
        for entry in self.extra:
            self.params = {k: str(v) for k, v in entry.items() if k not in given}
            returns += super().sweep(arguments)
        return returns
