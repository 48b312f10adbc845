"""The host meter (methods/hostmeter.py): host time and waits apart, per unit, and off."""

from __future__ import annotations

import time

import torch
from torch import nn

from methods.base import GradBuffer
from methods.hostmeter import OFF, HostMeter
from methods.plan import Unit
from methods.sched import OnReady

NAP_S = 0.02


def test_a_calls_waits_are_taken_out_of_its_host_time() -> None:
    meter = HostMeter()

    def synchronize() -> None:
        meter.wait(lambda: time.sleep(NAP_S))  # blocked on communication
        time.sleep(NAP_S / 2)                   # the method's own work

    meter.call(synchronize)
    assert NAP_S <= meter.wait_s < 1.5 * NAP_S + 0.01
    assert NAP_S / 2 <= meter.host_s < NAP_S
    meter.reset()
    assert (meter.host_s, meter.wait_s, meter.hook_s) == (0.0, 0.0, {})


def test_hooks_count_as_host_time_per_gradient_and_units_share_a_split_tensor() -> None:
    meter = HostMeter()
    hooks = [meter.hook(lambda _p: time.sleep(NAP_S), 0), meter.hook(lambda _p: None, 1)]
    for _ in range(2):  # two iterations
        for hook in hooks:
            hook(None)
    assert meter.host_s >= 2 * NAP_S and meter.hook_s[0] >= 2 * NAP_S
    assert meter.hook_s[1] < NAP_S
    # gradient 0 in two partitions, gradient 1 in one unit with nothing else
    first, second, third = meter.per_unit([[0], [0], [1]], iters=2)
    assert first == second == meter.hook_s[0] / 4 and third == meter.hook_s[1] / 2
    assert first + second + third == sum(meter.hook_s.values()) / 2
    # a forward gate waits for an update: all of it is wait time
    meter.gate(lambda _module, _args: time.sleep(NAP_S))(None, None)
    assert meter.wait_s >= NAP_S and meter.host_s < 3 * NAP_S


def test_a_meter_that_is_off_reads_no_clock_and_leaves_hooks_as_they_are() -> None:
    def hook(_p) -> None:
        return None

    assert OFF.hook(hook, 0) is hook and OFF.gate(hook) is hook
    assert OFF.call(lambda: 7) == 7 and OFF.wait(lambda: 8) == 8
    assert (OFF.host_s, OFF.wait_s, OFF.hook_s) == (0.0, 0.0, {})


class _SlowWait:
    """A unit whose communication takes NAP_S to come back (a transport's handle)."""

    def wait(self) -> None:
        time.sleep(NAP_S)

    complete = wait


class _Transport:
    ordered, identity, scale, rank, size, group = True, False, 1.0, 0, 1, None

    def start(self, chunk: torch.Tensor, *, key: int) -> _SlowWait:
        return _SlowWait()


def test_wfbps_hooks_and_its_wait_for_each_unit_land_where_they_belong() -> None:
    """OnReady (WFBP) on a model of three tensors in two units: every hook is timed under
    its gradient, and synchronize's wait for the two units is wait time, not host time."""
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1, bias=False))
    params = list(reversed(list(model.parameters())))
    buffer = GradBuffer(params)
    units = [Unit(params=(0,), start=0, end=3), Unit(params=(1, 2), start=3, end=18)]
    meter = HostMeter()
    sched = OnReady()
    sched.attach(model, buffer=buffer, units=units, transport=_Transport(), meter=meter)
    model(torch.ones(2, 4)).sum().backward()
    meter.call(sched.synchronize)
    assert sorted(meter.hook_s) == [0, 1, 2]
    assert 2 * NAP_S <= meter.wait_s and meter.host_s < NAP_S
    assert sum(meter.per_unit([u.params for u in units], iters=1)) == sum(meter.hook_s.values())
    assert meter.host_s >= sum(meter.hook_s.values())
    sched.close()
