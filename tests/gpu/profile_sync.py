"""GPU checklist step 14's miss (a measured profile predicting resnet50 on 1 GPU 13% too
slow): one iteration's length as the profile stamps it, reading each iteration's events
before the next starts (synchronized) or all after the last, beside the plain loop's."""
import statistics
import sys
import time

import torch

from harness import config
from harness.measure.bench import plain_training
from harness.predict import trace

model_name, iters = (sys.argv[1:] + ["resnet50"])[0], 20
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
model, optimizer, batch = plain_training(config.load([f"model={model_name}"]).model, seed=0,
                                         device=dev)


def total(stamps):
    marks = stamps[2]
    return [marks[1] - marks[0], marks[2] - marks[1], marks[3] - marks[2], marks[3] - marks[0]]


for how in ("each", "end", "each", "end"):
    if how == "each":
        runs = [total(trace._in_seconds(trace._trace(model, batch, trace._stamp, optimizer)))
                for _ in range(iters)]
    else:
        raw = [trace._trace(model, batch, trace._stamp, optimizer) for _ in range(iters)]
        runs = [total(trace._in_seconds(t)) for t in raw]
    med = [1e3 * statistics.median(c) for c in zip(*runs[2:])]
    print(f"{model_name} profile, events read {how:4s}: forward {med[0]:6.2f} backward "
          f"{med[1]:6.2f} update {med[2]:5.2f} iteration {med[3]:6.2f} ms")
for _ in range(2):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        loss = model(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    print(f"{model_name} plain loop, synchronized at the end: "
          f"{1e3 * (time.perf_counter() - t0) / iters:6.2f} ms an iteration")
