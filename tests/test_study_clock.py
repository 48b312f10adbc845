"""The study's clocks (issue 39): how a step ends (run.sync_each_step) and its throughput
statistic (run.rate), against hand-made steps and times."""

from __future__ import annotations

import pytest
import torch

from harness.measure import bench
from harness.measure.timing import Clock, study_rate
from methods.hostmeter import HostMeter


def test_the_study_rate_is_the_mean_of_ten_step_rates() -> None:
    # 20 steps: the first ten take 1 s each, the next ten 3 s each; 8 samples a step
    starts = [float(i) for i in range(11)] + [10.0 + 3 * i for i in range(1, 11)]
    rate = study_rate(starts, samples_per_step=8)
    assert rate == pytest.approx((80 / 10 + 80 / 30) / 2)  # 5.33 samples/s: mean of rates
    assert 160 / 40 < rate  # our window's rate (4.0): samples over the whole time
    # a partial round at the end is not a round; a window shorter than one round is one
    assert study_rate([*starts, 100.0], samples_per_step=8) == pytest.approx(rate)
    assert study_rate([0.0, 2.0, 3.0], samples_per_step=8) == pytest.approx(16 / 3)
    assert study_rate([], samples_per_step=8) is None


class _Method:
    """What train_iteration calls of a method, counted (the clock's logic alone)."""

    def __init__(self) -> None:
        self.meter, self.calls = HostMeter(on=True), []

    def synchronize(self) -> None:
        self.calls.append("synchronize")

    def step(self, optimizer) -> None:
        optimizer.step()

    def zero_grad(self) -> None:
        self.calls.append("zero_grad")

    def drain(self) -> None:
        self.calls.append("drain")


@pytest.mark.parametrize("ending, calls", [
    ("false", ["synchronize", "zero_grad"]),
    ("device", ["synchronize", "zero_grad", "device sync"]),  # the study's: no drain
    ("drain", ["synchronize", "zero_grad", "drain", "device sync"]),
])
def test_a_step_ends_as_its_clock_says(monkeypatch, ending: str, calls: list[str]) -> None:
    method = _Method()
    monkeypatch.setattr(bench, "device_sync", lambda device: method.calls.append("device sync"))
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    clock = Clock(torch.device("cpu"))
    bench.train_iteration(lambda batch: model(batch).sum(), method, optimizer,
                          torch.ones(2, 4), clock, ending=ending, device=torch.device("cpu"))
    assert method.calls == calls
    assert len(clock.moments) == 3  # after forward, backward and synchronize
