"""ByteScheduler's iterations as discrete events: a priority queue of pieces issued under a
credit (`issue`), and the per-parameter updates that the next forward waits for
(`iterate`), with the compute stream they share with the forward and the poller thread
that launches them (harness/predict/engines.py has the poller's costs)."""

from __future__ import annotations

import heapq
import itertools
import math

from harness.predict import profile
from harness.predict.cpushare import NONE as NO_SHARE
from harness.predict.cpushare import Share, beside
from harness.predict.engines import NONE, Engine
from methods.plan import Unit, fuse_pieces

ELEMENT_SIZE = 4  # fp32 gradients


def keys(units: list[Unit]) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Each unit's elements, and its place in the priority queue (input side first)."""
    return [u.numel for u in units], [(-u.params[0], u.start, i) for i, u in enumerate(units)]


def issue(units: list[Unit], ready: list[float], comm, credit: int, *,
          cycle_s: float = 0.0, fusion: int = 0,
          order: tuple[list[int], list[tuple[int, int, int]]] | None = None,
          started: list[float] | None = None, negotiation_s: float = 0.0,
          wake_s: float = 0.0) -> list[float]:
    """ByteScheduler: the highest-priority ready units (input side first) go while any
    of `credit` elements is left, each alone; with `cycle_s`, those of one cycle start
    at its end plus one negotiation round (`negotiation_s`), consecutive ones fused up to
    `fusion` elements (Priority._issue); `wake_s`: the scheduler thread, woken by an
    arrival or a completion, submits that much later (it waits for the GIL), then the
    cycle's tick. Returns each unit's finish (`order`:
    `keys(units)`, when the caller has them), and writes each unit's start into `started`
    when given. An event loop over arrivals, completions and cycle ticks, written for
    speed: the simulator spends most of its time here."""
    n = len(units)
    numel, rank = order or keys(units)
    done = [0.0] * n
    arrivals = sorted(range(n), key=ready.__getitem__)  # stable: ties in unit order
    arrive = [ready[u] for u in arrivals]
    queue: list[tuple[int, int, int]] = []  # (-tensor index: input side first, start, unit)
    flight: list[tuple[float, int]] = []    # (finish, elements)
    batch: list[int] = []
    push, pop, send = heapq.heappush, heapq.heappop, comm.issue
    used, now, nxt, tick = 0, 0.0, 0, 0.0
    while nxt < n or queue or batch:
        while nxt < n and arrive[nxt] <= now:
            push(queue, rank[arrivals[nxt]])
            nxt += 1
        while flight and flight[0][0] <= now:
            used -= pop(flight)[1]
        if not cycle_s and queue and used < credit:  # each goes alone, now
            soonest = math.inf
            while queue and used < credit:
                u = pop(queue)[2]
                used += numel[u]
                done[u] = finish = send(u, numel[u] * ELEMENT_SIZE, now + wake_s)
                if started is not None:
                    started[u] = now + wake_s
                push(flight, (finish, numel[u]))
                soonest = min(soonest, finish)
            if soonest <= now:  # one is back already (it moved nothing): its credit is free
                continue
        while queue and used < credit:  # a cycle: the pieces wait for its tick, together
            if not batch:  # the scheduler thread, woken now, submits once it has the GIL
                tick = math.ceil((now + wake_s) / cycle_s - 1e-9) * cycle_s
            batch.append(pop(queue)[2])
            used += numel[batch[-1]]
        if batch and now >= tick:
            for group in fuse_pieces([numel[u] for u in batch], fusion):
                members = [batch[i] for i in group]
                elements = sum(numel[u] for u in members)
                finish = send(members[0], elements * ELEMENT_SIZE, tick + negotiation_s)
                for u in members:
                    done[u] = finish
                    if started is not None:
                        started[u] = tick
                push(flight, (finish, elements))
            batch = []
            continue
        event = arrive[nxt] if nxt < n else math.inf  # the next arrival, completion or tick
        if queue and flight and flight[0][0] < event:
            event = flight[0][0]
        if batch and tick < event:
            event = tick
        if event == math.inf:
            break
        if event > now:
            now = event
    return done


class Stream:
    """The compute stream: work runs in the order it was launched, one item at a time.
    Other threads' work (updates, divisions) waits in `pending` until the training thread
    launches something after it."""

    def __init__(self) -> None:
        self.free = 0.0
        self.pending: list[tuple[float, int, float]] = []  # (launched, sequence, seconds)
        self.count = itertools.count()

    def launch_later(self, at: float, seconds: float) -> None:
        """Work another thread launched at `at`."""
        if seconds:
            heapq.heappush(self.pending, (at, next(self.count), seconds))

    def run(self, at: float, seconds: float) -> float:
        """The training thread launches `seconds` of work at `at`: when it ends."""
        self.flush(at)
        self.free = max(self.free, at) + seconds
        return self.free

    def flush(self, until: float = math.inf) -> float:
        """Run the other threads' work launched by `until`; the stream's end."""
        while self.pending and self.pending[0][0] <= until:
            at, _, seconds = heapq.heappop(self.pending)
            self.free = max(self.free, at) + seconds
        return self.free


def iterate(compute: profile.Compute, units: list[Unit], comm, *, credit: int,
            cycle_s: float, fusion: int, iterations: int, ending: str = "false",
            engine: Engine = NONE, log: list | None = None, share: Share = NO_SHARE
            ) -> list[float]:
    """ByteScheduler's iterations; the training thread's start of each next one.

    The training thread launches each forward step once the updates of the layers it
    needs are launched (ByteScheduler's forward pre-hooks), then the whole backward (it
    runs ahead of the GPU). Pieces go as `issue` says; the poller launches a tensor's
    update once all its pieces are reduced, one tensor after another (`engine`'s host
    time each), and the updates and the engine's divisions run on the compute stream in
    launch order with the forward. The step ends (`ending`, run.sync_each_step) at
    once (`false`), once the GPU has done what was launched by then, backward and pieces
    started included (`device`: torch.cuda.synchronize()), or with every piece and
    update done (`drain`). While the poller has updates to launch it holds the GIL: the
    training thread woken from a lock or a synchronize gets it `engine.gil_s` later; with
    `engine.sync_holds_gil` the synchronize keeps the GIL, and no piece goes before it
    returns. On shared cores (`share`), backward after the first unit's tensor computes at
    the rate the communication left it in the iteration before (cpushare.compute_rate)."""
    backward = [b + c for b, c in itertools.zip_longest(compute.backward_s, engine.copy_s,
                                                        fillvalue=0.0)]
    n, layers = len(compute.sizes), max(compute.layer_of) + 1
    total = sum(compute.sizes)
    gpu_update = [compute.update_s * s / total for s in compute.sizes]
    host = engine.update_host_s or [0.0] * n
    tensor_units: list[list[int]] = [[] for _ in range(n)]
    for u, unit in enumerate(units):
        for p in unit.params:
            tensor_units[p].append(u)
    last = [u.params[-1] for u in units]  # a unit is ready with its last tensor
    order = keys(units)
    stream, lock = Stream(), [0.0] * layers
    poller, t, ends, last_flight, rate = 0.0, 0.0, [], [], 1.0
    for it in range(iterations):
        ready_after = list(itertools.accumulate(beside(backward, min(last), rate)))
        begin = cpu = t
        for needs, seconds in compute.forward:
            for layer in needs:
                if lock[layer] > cpu:
                    woken = lock[layer] + (engine.gil_s if lock[layer] < poller else 0.0)
                    if log is not None:
                        log.append(("compute", "wait: update", cpu, woken, {}))
                    cpu = woken
            stream.run(cpu, seconds)
        start = stream.run(cpu, 0.0)
        ready = [start + r for r in ready_after]
        end = stream.run(cpu, ready[-1] - start)
        if log is not None:
            log += [("compute", "forward", begin, start, {}),
                    ("compute", "backward", start, end, {})]
        started = [math.inf] * len(units)
        comm.busy_until = end + compute.forward_s  # and, at best, the next forward
        frozen = ending == "device" and engine.sync_holds_gil
        if frozen:  # the Python threads wait out the training thread's synchronize
            t = _step_end(ending, cpu, end, stream, lock, last_flight)
            ready = [max(r, t) for r in ready]
        done = issue(units, [ready[p] for p in last], comm, credit, cycle_s=cycle_s,
                     fusion=fusion, order=order, started=started,
                     negotiation_s=engine.negotiation_s, wake_s=engine.gil_s)
        rate = share.compute_rate(min(ready[p] for p in last), max(done))
        for u, finish in enumerate(done):  # Horovod's callback divides on the compute stream
            stream.launch_later(finish, engine.divide_s[u] if engine.divide_s else 0.0)
        poller = _poll(tensor_units, done, gpu_update, host, compute.layer_of, stream, lock,
                       poller, log)
        if not frozen:
            t = _step_end(ending, cpu, end, stream, lock, last_flight)
            if ending == "device" and t < poller:  # back from synchronize: the poller's GIL
                t += engine.gil_s
        last_flight = list(zip(started, done))
        ends.append(t)
        if log is not None:
            log.append(("compute", "traced iteration" if it == iterations - 1 else
                        f"iteration {it + 1}", begin, t, {}))
    return ends


def _poll(tensor_units: list[list[int]], done: list[float], gpu_update: list[float],
          host: list[float], layer_of: list[int], stream: Stream, lock: list[float],
          poller: float, log: list | None) -> float:
    """The poller: each tensor's update launched after its last piece is done, one after
    another; each layer's lock released once its tensors' updates are launched. Returns
    when the poller is free."""
    finished = [(max(done[u] for u in us), p) for p, us in enumerate(tensor_units) if us]
    for layer in {layer_of[p] for _, p in finished}:
        lock[layer] = 0.0
    for when, p in sorted(finished):
        poller = max(poller, when) + host[p]
        stream.launch_later(poller, gpu_update[p])
        layer = layer_of[p]
        lock[layer] = max(lock[layer], poller)
        if log is not None:
            log.append(("updates", f"update tensor {p}", poller - host[p], poller, {}))
    return poller


def _step_end(ending: str, cpu: float, end_of_backward: float, stream: Stream,
              lock: list[float], last_flight: list[tuple[float, float]]) -> float:
    """When the training thread starts the next iteration (see `iterate`)."""
    if ending == "drain":
        return max(stream.flush(), max(lock))
    if ending == "device":  # the backward, and the pieces started before the call
        return max([end_of_backward, *(f for s, f in last_flight if s <= cpu)])
    return cpu
