"""BytePS v0.2.3's server engine (byteps/server/server.cc, server.h, queue.h) rule by
rule, through the real server objects: pushes replayed into `Server.arrived` and the
engine queues read in the order an engine thread would serve them, keys bound to engine
threads by the fewest bytes bound so far, and the study's PS methods on 8 threads."""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import shutil
import subprocess
import threading

import pytest
import torch
import torch.distributed as dist

from harness import config
from methods.ps import wire
from methods.ps.server import COPY, SUM, Server, _Plan, serve
from methods.ps.server_queue import EngineQueue, ThreadBinding
from methods.ps.transport import stop_servers
from methods.ps.wire import CLOSE, CTRL_TAG, KEY_TAG, LAYOUT_TAG, OPEN, PUSH, header
from tests.test_methods import _free_port, _spawn

R, X = 1, 2  # two keys


def _server(keys: dict[int, int], *, nodes: int, threads: int = 1,
            schedule: bool = True) -> tuple[Server, _Plan]:
    """A server with one open plan of `keys` ({key: elements}) pushed by `nodes` roots,
    its engine threads stopped so that the queued work stays queued for the test to read."""
    server = Server(num_workers=nodes)
    server.stopped.set()  # each engine thread exits before taking anything
    layout = torch.tensor([[k, n] for k, n in keys.items()], dtype=torch.int64).reshape(-1)
    plan = _Plan(layout, torch.float32, workers=nodes, node_size=1, schedule=schedule,
                 threads=threads)
    return server, plan


def _push(server: Server, plan: _Plan, key: int, node: int) -> None:
    server.arrived(plan, plan.slots[key], node)


def _served(queue: EngineQueue) -> list[tuple[str, int, int]]:
    """Everything `queue` holds, in the order its engine thread would take it."""
    out = []
    while (item := queue.get(0)) is not None:
        op, _, slot, node = item
        out.append(({SUM: "sum", COPY: "copy"}[op], slot.key, node))
    return out


def test_replayed_pushes_are_served_in_bytepses_order() -> None:
    """Four nodes push keys R and X; one engine thread, scheduling on. Worked out by hand
    from BytePS's rules (server.cc BytePSHandler, queue.h):
    - a round's first push of a key is the running sum in place: nothing is queued;
      each later push queues a SUM, the last one then a COPY (into the answer), and
      right after it the key's count is cleared (ClearCounter);
    - Push counts the key, then std::push_heap; WaitAndPop is std::pop_heap: the top
      goes, the old back is sifted in from the top; a message ranks higher with FEWER
      counted pushes of its key, then with an older id; a cleared count moves nothing.

    Queued: r1 (id 0, R counts 1), r2 (id 1, R 2), x1 (id 2, X 1: ranks above r1 (R 2),
    sifts to the top), x2 (id 3, X 2), r3 (id 4, R 3), copy-R (id 5, R 4), then R's count
    cleared to 0. Heap: [x1, r2, r1, x2, r3, copyR].
    Served: x1 (the top, pushed when R counted 2, stays the top: the heap is not
    rebuilt); then R's work compares at count 0 and X's at 2, so r1, r2, r3, copy-R (ids
    0, 1, 4, 5) all go before the older x2 (id 3); x2 last.
    FIFO would serve r1 r2 x1 x2 r3 copy-R; counts reset only after the sums (as here
    before) would serve x1 x2 before all of R.
    """
    server, plan = _server({R: 4, X: 4}, nodes=4)
    for key, node in ((R, 0), (R, 1), (R, 2), (X, 0), (X, 1), (X, 2), (R, 3)):
        _push(server, plan, key, node)
    assert _served(server.queues[0]) == [
        ("sum", X, 1), ("sum", R, 1), ("sum", R, 2), ("sum", R, 3), ("copy", R, 0),
        ("sum", X, 2)]
    assert plan.slots[R].arrived == 0 and plan.slots[X].arrived == 3  # R's round is done


def test_the_engine_taking_work_between_pushes_and_fifo_without_scheduling() -> None:
    """Four nodes, one thread, the engine taking one message between some pushes. By hand:
    r1 (R 1), r2 (R 2), x1 (X 1: to the top); the engine takes x1. Then x2 (X 2) and r3,
    copy-R (R 4, then cleared to 0): the heap [r1, r2, x2, r3, copyR] after x1's pop had
    r1 on top, and R at 0 now ranks all its work above x2 (X 2): r1, r2, r3, copy-R, x2.
    Without scheduling the same pushes are served in arrival order."""
    pushes = ((R, 0), (R, 1), (R, 2), (X, 0), (X, 1), None, (X, 2), (R, 3))
    for schedule, order in (
            (True, [("sum", X, 1), ("sum", R, 1), ("sum", R, 2), ("sum", R, 3),
                    ("copy", R, 0), ("sum", X, 2)]),
            (False, [("sum", R, 1), ("sum", R, 2), ("sum", X, 1), ("sum", X, 2),
                     ("sum", R, 3), ("copy", R, 0)])):
        server, plan = _server({R: 4, X: 4}, nodes=4, schedule=schedule)
        got: list = []
        for push in pushes:
            if push is None:
                got += _served_one(server.queues[0])
            else:
                _push(server, plan, *push)
        assert got + _served(server.queues[0]) == order, schedule


def _served_one(queue: EngineQueue) -> list[tuple[str, int, int]]:
    op, _, slot, node = queue.get(0)
    return [({SUM: "sum", COPY: "copy"}[op], slot.key, node)]


def test_one_pusher_queues_only_the_copy_and_every_round_starts_again() -> None:
    server, plan = _server({R: 2}, nodes=1)
    for _ in range(2):
        _push(server, plan, R, 0)
    assert _served(server.queues[0]) == [("copy", R, 0), ("copy", R, 0)]
    assert server.queues[0].counted[R] == 0


def test_a_copy_served_before_its_keys_last_sum_waits_for_it() -> None:
    """BytePS's heap can serve a key's COPY_MERGED before one of its SUM_RECVs: pushes of
    three keys from three nodes, the engine taking a message at each None, serve key 3's
    copy before its sum of node 1 (found by replaying random pushes under BytePS's rules;
    counts move under a heap that is never rebuilt). BytePS would then answer a sum
    missing a push; the server's copy waits for the key's last sum and every answer is
    the sum of the three pushes."""
    server, plan = _server({1: 4, 2: 4, 3: 4}, nodes=3)
    answers = {}  # no worker to send them to: each key's answer as it would leave
    server._answer = lambda plan, slot: answers.setdefault(slot.key, slot.inputs[slot.merged] + 0)
    pushed = {key: [torch.full((4,), float(10 ** node * key)) for node in range(3)]
              for key in plan.slots}
    for key, slot in plan.slots.items():
        for node in range(3):
            slot.inputs[node].copy_(pushed[key][node])
    served = []
    for push in ((3, 2), (1, 1), (1, 2), (2, 1), (2, 2), (3, 0), (3, 1), None, (1, 0), None,
                 (2, 0), None, None, None, None, None, None, None):
        if push is not None:
            _push(server, plan, *push)
            continue
        op, _, slot, node = item = server.queues[0].get(0)
        served.append(({SUM: "sum", COPY: "copy"}[op], slot.key, node))
        server._run(*item)
    assert served.index(("copy", 3, 2)) < served.index(("sum", 3, 1)), served
    for key, slot in plan.slots.items():
        assert torch.equal(answers[key], sum(pushed[key])), (key, answers[key])
        assert (slot.summed, slot.held) == (0, False)


def test_keys_bind_to_the_thread_with_the_fewest_bytes_bound_so_far() -> None:
    """GetThreadID by hand, 3 threads, keys first seen in this order with these bytes:
    k1 400 -> t0 (all 0, lowest index) [400, 0, 0]; k2 100 -> t1 [400, 100, 0];
    k3 100 -> t2 [400, 100, 100]; k4 50 -> t1 (t1, t2 tie at 100) [400, 150, 100];
    k5 300 -> t2 [400, 150, 400]; k6 10 -> t1 [400, 160, 400]; k1 again stays on t0."""
    binding = ThreadBinding(3)
    got = [binding.bind(k, n) for k, n in ((1, 400), (2, 100), (3, 100), (4, 50), (5, 300),
                                           (6, 10), (1, 400))]
    assert got == [0, 1, 2, 1, 2, 1, 0]
    assert binding.load == [400, 160, 400]
    with pytest.raises(ValueError, match="engine_threads=0"):
        ThreadBinding(0)


def test_the_server_queues_each_keys_work_on_its_bound_thread() -> None:
    """Through the server: fp32 keys of 100, 25, 25 and 10 elements (400, 100, 100, 40
    bytes) first pushed in that order on 3 threads go to threads 0, 1, 2, 1, every push of
    a key on its own thread's queue, whichever node pushes first in a round."""
    keys = {10: 100, 11: 25, 12: 25, 13: 10}
    server, plan = _server(keys, nodes=2, threads=3, schedule=False)
    for first, second in ((0, 1), (1, 0)):  # two rounds, the nodes in either order
        for key in keys:
            _push(server, plan, key, first)
        for key in keys:
            _push(server, plan, key, second)
    assert plan.binding.thread_of == {10: 0, 11: 1, 12: 2, 13: 1}
    assert len(server.queues) == len(server.engines) == 3
    served = [_served(q) for q in server.queues]
    assert served[0] == [("sum", 10, 1), ("copy", 10, 0), ("sum", 10, 0), ("copy", 10, 1)]
    assert [k for _, k, _ in served[1]] == [11, 11, 13, 13, 11, 11, 13, 13]
    assert {k for _, k, _ in served[2]} == {12}


def test_an_engine_thread_wakes_for_work_from_another_thread() -> None:
    queue = EngineQueue()
    threading.Timer(0.05, queue.put, args=(7, "late")).start()
    assert queue.get(5) == "late"
    assert queue.get(0.01) is None


@pytest.mark.parametrize("method", ["bsp_ps", "wfbp_ps", "bytescheduler_ps", "priority_ps"])
def test_the_ps_methods_run_bytepses_server_as_the_study_did(method: str) -> None:
    transport = config.load([f"method={method}"]).method.transport
    assert transport.engine_threads == 8  # the study's BYTEPS_SERVER_ENGINE_THREAD=8
    assert transport.server_schedule is (method == "bytescheduler_ps")



# BytePS v0.2.3's PriorityQueue (queue.h) over libstdc++'s heap, driven by a script:
# "p key" Push, "c key" ClearCounter, "g" WaitAndPop (prints the message id)
QUEUE_H = r"""
#include <algorithm>
#include <cstdint>
#include <iostream>
#include <unordered_map>
#include <vector>
struct Msg { uint64_t id, key; };
std::vector<Msg> queue_;
std::unordered_map<uint64_t, uint64_t> push_cnt_;
bool ComparePriority(const Msg& a, const Msg& b) {
  if (push_cnt_[a.key] == push_cnt_[b.key]) return a.id > b.id;
  return push_cnt_[a.key] > push_cnt_[b.key];
}
int main() {
  char op; uint64_t key, timestamp = 0;
  while (std::cin >> op) {
    if (op == 'p') {
      std::cin >> key; queue_.push_back(Msg{timestamp++, key}); ++push_cnt_[key];
      std::push_heap(queue_.begin(), queue_.end(), ComparePriority);
    } else if (op == 'c') {
      std::cin >> key; push_cnt_[key] = 0;
    } else {
      std::pop_heap(queue_.begin(), queue_.end(), ComparePriority);
      std::cout << queue_.back().id << "\n"; queue_.pop_back();
    }
  }
}
"""


def test_the_scheduled_queue_is_libstdcxx_heap_under_bytepses_comparator(tmp_path) -> None:
    """300 random traces of pushes, counter clears and pops on 5 keys: our queue serves
    exactly what BytePS's queue.h, compiled with g++, serves."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ is not installed: cannot compile BytePS's queue to compare with")
    (tmp_path / "queue.cc").write_text(QUEUE_H)
    subprocess.run([compiler, "-O1", "-o", str(tmp_path / "queue"), str(tmp_path / "queue.cc")],
                   check=True, timeout=120)
    for seed in range(300):
        rng, ops, queued = random.Random(seed), [], 0
        for _ in range(rng.randint(1, 60)):
            r = rng.random()
            if r < 0.5:
                ops.append(f"p {rng.randint(0, 4)}")
                queued += 1
            elif r < 0.65:
                ops.append(f"c {rng.randint(0, 4)}")
            elif queued:
                ops.append("g")
                queued -= 1
        ops += ["g"] * queued
        want = subprocess.run([str(tmp_path / "queue")], input="\n".join(ops), text=True,
                              capture_output=True, check=True).stdout.split()
        queue, got, ids = EngineQueue(), [], iter(range(len(ops)))
        for op in ops:
            if op[0] == "p":
                queue.put(int(op[2:]), str(next(ids)), schedule=True)
            elif op[0] == "c":
                queue.clear_count(int(op[2:]))
            else:
                got.append(queue.get(0))
        assert got == want, f"seed {seed}: {ops}"


def _serving(rank: int, world: int, port: int) -> bool:
    """Gloo and the PS wire up on 2 ranks; rank 1 serves until rank 0 stops it (True),
    rank 0 goes on (False)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=dt.timedelta(seconds=20))
    wire.start("gloo", store=None, rank=rank, timeout_s=20)
    if rank == 1:
        serve(num_workers=1)
    return rank == 1


def _report(result: dict, out: str, *, close: bool = True) -> None:
    """Rank 0: close the plan and stop the server (`close`), write `result`, exit."""
    if close:
        wire.send(header(CLOSE), 1, tag=CTRL_TAG)
        stop_servers(num_workers=1)
    with open(out, "w") as f:
        json.dump(result, f)
    os._exit(0)


def _early_push_rank(rank: int, world: int, port: int, out: str) -> None:
    """Rank 1 serves; rank 0 announces keys 0 and 1 in two headers, sends key 1's push
    first and waits for it to leave, then key 0's, and reads both answers."""
    if _serving(rank, world, port):
        return
    pushes = [torch.full((1000,), 1.0 + key) for key in (0, 1)]
    answers = [torch.zeros(1000) for _ in (0, 1)]
    wire.send(header(OPEN, [2, 1, 0, 1]), 1, tag=CTRL_TAG)
    wire.send(torch.tensor([0, 1000, 1, 1000]), 1, tag=LAYOUT_TAG)
    for key in (0, 1):
        wire.send(header(PUSH, [key]), 1, tag=CTRL_TAG)
    pulls = [wire.irecv(answers[key], 1, tag=KEY_TAG + key) for key in (0, 1)]
    try:  # Gloo sends a message once its receive is posted: key 1's, or never (20 s)
        wire.isend(pushes[1], 1, tag=KEY_TAG + 1).wait()
        early = "left"
    except RuntimeError as exc:
        early = str(exc).splitlines()[0]
    result = {"early": early}
    if early == "left":
        wire.isend(pushes[0], 1, tag=KEY_TAG).wait()
        for pull in pulls:
            pull.wait()
        result["answers"] = [a.unique().tolist() for a in answers]
    _report(result, out, close=early == "left")


def test_a_push_goes_once_its_header_arrived_whatever_the_server_waits_for(tmp_path) -> None:
    """The server posts each announced push's receive as its header arrives: a worker's
    push of key 1 leaves while the server still waits for key 0's, announced before it
    (posted only once key 0 had landed, it would wait for ever: Gloo sends a message only
    to a posted receive). Both answers are then the pushes' sums."""
    out = tmp_path / "worker.json"
    codes = _spawn(_early_push_rank, 2, _free_port(), str(out), timeout_s=120)
    got = json.loads(out.read_text())
    assert got["early"] == "left", got
    assert got["answers"] == [[1.0], [2.0]], got
    assert codes == [0, 0], codes


def _headers_ahead_rank(rank: int, world: int, port: int, out: str) -> None:
    """Rank 1 serves; rank 0 sends OPEN but holds back its layout (the server's reader waits
    for it), sends three PUSH headers meanwhile and counts those that left within 2 s;
    then the layout, the pushes, the answers, CLOSE and STOP."""
    if _serving(rank, world, port):
        return
    keys = (0, 1, 2)
    wire.send(header(OPEN, [len(keys), 1, 0, 1]), 1, tag=CTRL_TAG)
    heads = [wire.isend(header(PUSH, [key]), 1, tag=CTRL_TAG) for key in keys]
    left = 0
    try:  # Gloo's handles tell completion only in wait
        for head in heads:
            head.wait(dt.timedelta(seconds=2))
            left += 1
    except RuntimeError:
        pass
    result = {"left": left}
    wire.send(torch.tensor([v for key in keys for v in (key, 100)]), 1, tag=LAYOUT_TAG)
    answers = [torch.zeros(100) for _ in keys]
    works = [w for key in keys for w in (
        wire.isend(torch.full((100,), 1.0 + key), 1, tag=KEY_TAG + key),
        wire.irecv(answers[key], 1, tag=KEY_TAG + key))] + heads[left:]
    for work in works:
        work.wait()
    result["answers"] = [a.unique().tolist() for a in answers]
    _report(result, out)


def test_a_header_leaves_whatever_header_the_server_is_still_reading(tmp_path) -> None:
    """The server keeps CTRL_AHEAD receives of a worker's control stream posted: three
    PUSH headers leave while its reader still waits for the plan's layout (with one
    receive posted at a time, none could: Gloo sends a message only to a posted receive,
    and the next was posted once the one before was handled). The answers are the pushes,
    and the worker's STOPs, one for each posted receive, end the server."""
    out = tmp_path / "worker.json"
    codes = _spawn(_headers_ahead_rank, 2, _free_port(), str(out), timeout_s=120)
    got = json.loads(out.read_text())
    assert got == {"left": 3, "answers": [[1.0], [2.0], [3.0]]}, got
    assert codes == [0, 0], codes
