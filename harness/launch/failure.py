"""Why a run failed, told once: each rank's last words, the first cause, one failed row.

A failure spreads: when one rank dies, its peers fail too, with symptoms
("Connection reset by peer", "Timed out waiting ... for recv", "parameter server
rank 2 failed"). The row must name the cause, so the evidence is kept apart:

- every locally spawned rank writes its progress to `beat.rank<r>` in the run
  folder (`beat`) and, when it fails, `error.rank<r>.json` with the
  error and whether it is a peer's symptom (`symptom`);
- the launcher, which alone sees how each process ended, picks the first cause
  (`cause`) and writes the run's one failed row (`record`).

Under srun no launcher sees the ranks end: a rank records its own error, and every
rank beats and leaves its last words in the array script's run folder
(`DDLBENCH_RUN_DIR`, beside the logs); when srun fails the script runs
`python -m harness.launch.failure`, which takes the ends srun reported from the log
and names the cause as the local launcher would (`srun_cause`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from harness import config
from harness.config.ranks import num_workers
from harness.launch import ports

# Errors a rank gets because another one failed (Gloo, NCCL, the TCP store, sockets):
# a peer that did not answer in time, or a peer that went away. Horovod shuts itself down
# when a collective of its background thread fails, and every later call then raises
# HorovodInternalError "Horovod has been shut down": with a peer that went away the
# launcher sees that peer's end first, so what remains is a peer that did not answer
# within HOROVOD_GLOO_TIMEOUT_SECONDS (run.timeout_s), a timeout.
TIMED_OUT = re.compile(r"[Tt]imed out|[Tt]imeout|NCCL communicator was aborted"
                       r"|Horovod has been shut down")
CLOSED = re.compile(r"Connection (reset|closed|refused)|Broken pipe|ECONNRESET|EPIPE")
# srun's word on a task killed by a signal is the signal's description (strsignal)
SIGNAL_WORDS = {signal.strsignal(s): s for s in signal.Signals if signal.strsignal(s)}
NCCL_ABORT = ("NCCL's watchdog aborts a rank whose collective waited past its timeout, "
              "set longer than run.timeout_s")


def symptom(exc: BaseException) -> str:
    """'timeout' or 'closed' when `exc`, or an error it was raised from, is a peer's
    failure seen from here (Horovod's shut down included); '' when it is this rank's own."""
    dist = sys.modules.get("torch.distributed")  # not imported: no error of it was raised
    seen: BaseException | None = exc
    while seen is not None:
        if (isinstance(seen, TimeoutError) or TIMED_OUT.search(str(seen))
                or type(seen).__name__ == "HorovodInternalError"):
            return "timeout"
        if (dist and isinstance(seen, dist.DistError)) or CLOSED.search(str(seen)):
            return "closed"
        seen = seen.__cause__
    return ""


def beat(run_dir: Path | None, rank: int, repeat: int, where: str) -> None:
    """A rank's progress, for the failure report (and the local launcher's watchdog);
    under torchrun, `run_dir` None, nobody watches."""
    if run_dir is not None:
        (run_dir / f"beat.rank{rank}").write_text(f"{repeat}\t{where}")


def write_error(run_dir: Path, rank: int, exc: BaseException, text: str) -> None:
    """A failing rank's last words, for the local launcher."""
    (run_dir / f"error.rank{rank}.json").write_text(json.dumps({
        "rank": rank, "error": text, "symptom": symptom(exc), "time": time.time()}))


@dataclass
class Ending:
    """How the local launcher saw a run end."""

    code: int                                             # the run's exit code
    exits: dict[int, int] = field(default_factory=dict)   # ranks that ended by themselves
    alive: list[int] = field(default_factory=list)        # ranks the launcher had to stop
    interrupt: str = ""  # why the launcher was stopped (SIGINT, SIGTERM), where the run was
    stall: str = ""      # the watchdog's finding, when no rank made progress
    silence: dict[int, float] = field(default_factory=dict)  # alive ranks: s since their beat


def _beats(run_dir: Path) -> dict[int, tuple[int, str]]:
    """Each rank's last beat: (repeat, where)."""
    out = {}
    for path in run_dir.glob("beat.rank*"):
        try:
            repeat, where = path.read_text().split("\t", 1)
            out[int(path.name.removeprefix("beat.rank"))] = (int(repeat), where)
        except (OSError, ValueError):
            continue
    return out


def _errors(run_dir: Path) -> dict[int, dict]:
    out = {}
    for path in run_dir.glob("error.rank*.json"):
        try:
            err = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        out[err["rank"]] = err
    return out


def last_progress(run_dir: Path, *, since: float) -> float:
    """When any rank last beat (wall clock), or `since` if later: the beats' mtimes, read
    on every poll of the launcher without opening them."""
    times = [since]
    for path in run_dir.glob("beat.rank*"):
        try:
            times.append(path.stat().st_mtime)
        except OSError:
            continue
    return max(times)


def silence(run_dir: Path, ranks: list[int], *, now: float | None = None) -> dict[int, float]:
    """Seconds since each of `ranks` last beat (0 for one that never did), at `now`."""
    now = time.time() if now is None else now
    out = {}
    for rank in ranks:
        try:
            out[rank] = max(0.0, now - (run_dir / f"beat.rank{rank}").stat().st_mtime)
        except OSError:
            out[rank] = 0.0
    return out


def symptoms_only(run_dir: Path, ranks: list[int]) -> bool:
    """Whether every one of `ranks` failed with a peer's symptom (so the cause is elsewhere)."""
    errors = _errors(run_dir)
    return all(r in errors and errors[r]["symptom"] for r in ranks)


def _at(beat: tuple[int, str] | None) -> str:
    return f" at repeat {beat[0]}, {beat[1]}" if beat else " while starting"


def where(run_dir: Path, rank: int) -> str:
    """Where `rank` last said it was, as " at repeat R, <where>"."""
    return _at(_beats(run_dir).get(rank))


def stalled(run_dir: Path, *, idle_s: float, ranks: int) -> str:
    """The launcher's reason when no rank has beaten for `idle_s`."""
    beats = _beats(run_dir)
    last = "; ".join(f"rank {r}{_at(beats[r])}" for r in sorted(beats)[:4]) or "none"
    return (f"no rank made progress for {idle_s:.0f} s (run.timeout_s plus grace); "
            f"last progress: {last}"
            + (f" (of {ranks} ranks)" if len(beats) > 4 else ""))


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def cause(run_dir: Path, ending: Ending, *, workers: int, timeout_s: float = math.inf
          ) -> tuple[str, int | None]:
    """The first cause of a failed local run, and the repeat it hit (None: unknown).

    In order: the launcher's own reason (a signal to it); a port collision (the rendezvous
    port taken by someone else between the check and the bind); a rank that died
    without saying why (a signal, `os._exit`); a rank's own error; no progress at
    all; a rank its peers timed out on or lost (a gloo pair that times out on one side
    closes on the other): one still running without an error, else the one their
    timeouts name, else one that only saw its peers go away; the earliest symptom.
    A rank killed by SIGABRT without a word while another rank, still running, had not
    beaten for `timeout_s` (run.timeout_s) is a symptom too: NCCL's watchdog aborts a
    rank whose collective waited that long on a frozen peer (the silent one is blamed).
    """
    errors, beats = _errors(run_dir), _beats(run_dir)
    own = sorted((e for e in errors.values() if not e["symptom"]), key=lambda e: e["time"])
    hard = [r for r, c in ending.exits.items() if c != 0 and r not in errors]
    symptoms = sorted((e for e in errors.values() if e["symptom"]), key=lambda e: e["time"])
    timeouts = [e for e in symptoms if e["symptom"] == "timeout"]
    silent = [r for r in ending.alive if r not in errors]  # still running, saying nothing
    waited = [r for r in silent if ending.silence.get(r, 0.0) >= timeout_s]
    aborted = [r for r in hard if ending.exits[r] == -signal.SIGABRT] if waited else []
    hard = [r for r in hard if r not in aborted]
    hung = waited + silent + [r for r in _named(timeouts) if r in errors] + [  # named; saw go
        e["rank"] for e in symptoms if e["symptom"] == "closed"]
    taken = [e for e in errors.values() if ports.IN_USE.search(e["error"])]
    if ending.interrupt:
        text, rank = ending.interrupt, None
    elif taken:  # not a rank's failure: the port was another program's or run's first
        text, rank = (f"port collision: the rendezvous port was taken by another program "
                      f"or run as rank {taken[0]['rank']} started ({taken[0]['error']}); run "
                      "again with cluster.master_port=0 (a free port per run) or another "
                      "free port"), None
    elif hard:
        rank = hard[0]
        text = f"rank {rank} {_how(ending.exits[rank])}{_at(beats.get(rank))}"
    elif own:
        text, rank = own[0]["error"], own[0]["rank"]
    elif ending.stall:
        text, rank = ending.stall, None
    elif hung and (timeouts or silent) and (symptoms or aborted):
        rank = hung[0]
        saw = _peers_saw(timeouts, symptoms, aborted, beats)
        text = f"rank {rank} hung{_at(beats.get(rank))}: {saw}"
    elif symptoms:
        text, rank = symptoms[0]["error"], symptoms[0]["rank"]
    else:
        rank = next(iter(ending.exits), None)
        text = f"rank {rank} {_how(ending.exits[rank])}" if rank is not None else "unknown"
    if rank is not None and rank < workers and rank in beats:
        return text, beats[rank][0]
    worker_repeats = [b[0] for r, b in beats.items() if r < workers]
    return text, max(worker_repeats) if worker_repeats else None


def _peers_saw(timeouts: list[dict], symptoms: list[dict], aborted: list[int],
               beats: dict[int, tuple[int, str]]) -> str:
    """How a silent rank's peers saw it: time out, go away, or abort waiting on it."""
    if symptoms:
        why = "timed out waiting on" if timeouts else "lost their connection to"
        return f"its peers {why} it; {(timeouts or symptoms)[0]['error']}"
    return (f"rank {aborted[0]} {_how(-signal.SIGABRT)}{_at(beats.get(aborted[0]))} waiting "
            f"on it ({NCCL_ABORT})")


def _named(timeouts: list[dict]) -> list[int]:
    """The ranks that timeouts name as the peer that did not answer (not themselves)."""
    found = (re.search(r"parameter server rank (\d+)", e["error"]) for e in timeouts)
    return [int(m.group(1)) for e, m in zip(timeouts, found)
            if m and int(m.group(1)) != e["rank"]]


def record(cfg: DictConfig, *, entry: str, run_id: str, repeat: int | None, error: str) -> None:
    """Keep the failure as data: the entry's `record_failure` (if it has one) decides
    which repeat gets a failed row (None: the first without a result) and writes it."""
    module = importlib.import_module(entry)
    if not hasattr(module, "record_failure"):
        return
    try:
        module.record_failure(cfg, run_id=run_id, repeat=repeat, error=error)
    except OSError as exc:  # a full or vanished disk: say so, the exit code stays
        print(f"ddlbench: could not write the failed row of run {run_id}: {exc}",
              file=sys.stderr)


def error_line(log: Path) -> str:
    """The line of a task's log that tells why srun failed: srun's first word on a task
    ("task 1: Exited with exit code 3"; later ones are mostly the tasks it then
    killed), else the last line that reads like an error, else the last line."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return f"(no log at {log})"
    tasks = [ln for ln in lines if re.search(r"srun: error: .*task \d+: ", ln)]
    flagged = [ln for ln in lines if re.search(
        r"[Ee]rror|failed|[Kk]illed|CANCELLED|Exception|terminate|oom", ln)]
    return (tasks[:1] or flagged[-1:] or lines[-1:] or ["(empty log)"])[0][:500]


def srun_ends(said: str) -> dict[int, int]:
    """The end srun reported for a task in `said` (`error_line`), as a local exit code:
    "task 1: Exited with exit code 3" is {1: 3}, "task 0: Aborted (core dumped)" {0: -6}
    (srun names a signal by its description: Killed, Segmentation fault). "Terminated" is
    none: Slurm ends a step's tasks so (a cancel, the time limit, another task's failure)."""
    task = re.search(r"srun: error: .*task (\d+): (.+)", said)
    if task is None:
        return {}
    rank, end = int(task.group(1)), task.group(2).removesuffix(" (core dumped)").strip()
    code = re.fullmatch(r"Exited with exit code (\d+)", end)
    if code:
        return {rank: int(code.group(1))}
    sig = SIGNAL_WORDS.get(end)
    return {rank: -sig} if sig is not None and sig != signal.SIGTERM else {}


def srun_cause(run_dir: Path, said: str, *, code: int, workers: int,
               timeout_s: float = math.inf) -> tuple[str, int | None]:
    """The first cause of a failed srun step, from its run folder and what srun said
    (`error_line`): its first report of a task that ended (`srun_ends`) is that rank's
    end; a rank that beat but neither ended nor left an error was still running (hung),
    silent since its last beat."""
    exits = srun_ends(said)
    errors = _errors(run_dir)
    alive = [r for r in sorted(_beats(run_dir)) if r not in errors and r not in exits]
    return cause(run_dir, Ending(code=code, exits=exits, alive=alive,
                                 silence=silence(run_dir, alive)),
                 workers=workers, timeout_s=timeout_s)


def main(argv: list[str]) -> int:
    """`python -m harness.launch.failure --entry MODULE --run-id ID --exit-code N --log FILE --
    [overrides]`:
    the array script's record of a task whose srun failed."""
    parser = argparse.ArgumentParser(prog="python -m harness.launch.failure",
                                     description=main.__doc__)
    parser.add_argument("--entry", required=True,
                        help="the entry that ran, e.g. harness.measure.bench")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--exit-code", type=int, required=True)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--run-dir", type=Path, help="the ranks' beats and errors")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    cfg = config.load(args.overrides)
    said = error_line(args.log)
    error, repeat = f"srun exited with code {args.exit_code}: {said}", None
    if args.run_dir is not None and args.run_dir.is_dir():
        named, repeat = srun_cause(args.run_dir, said, code=args.exit_code,
                                   workers=num_workers(cfg), timeout_s=cfg.run.timeout_s)
        error = f"{named} ({error})"
    print(f"ddlbench: run {args.run_id} failed: {error}", file=sys.stderr)
    record(cfg, entry=args.entry, run_id=args.run_id, repeat=repeat, error=error)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
