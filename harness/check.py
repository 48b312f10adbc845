"""`python -m harness.check [overrides]`: preflight of a cluster, before any benchmark.

    python -m harness.check cluster.workers_per_node=2
    python -m harness.check model=bert_tiny method=ddp,bsp_ps     # only these methods
    torchrun --nproc-per-node=4 -m harness.check cluster.workers_per_node=4
    srun -N2 --ntasks-per-node=4 python -m harness.check cluster.nodes=2 cluster.workers_per_node=4
    python -m harness.check --clean    # remove what killed runs left behind, and say what

Three sections, on the cluster the overrides describe:

1. environment: every rank's host, role, device and network interfaces, and the
   torch / CUDA / cuDNN / NCCL / driver / Horovod versions, gathered to rank 0;
2. process groups: one small all-reduce on every group a run uses (the default
   group with a CPU tensor, the workers' group with a tensor on the workers' device);
3. methods: a `verify.steps`=2 run of `harness.verify` of every method of
   conf/method/ (or those `method=a,b` names), each a launch of its own.

It ends with one line per check, `<name>: ok` or `<name>: FAILED <why>`, and exits 1
when any failed. Bad input is one line and exit 2 before anything starts; a method
whose configuration does not hold on this cluster is a failed check. Under
torchrun/srun every process runs the same launches in the same order; a method needing
another number of processes than the launcher started (PS methods add servers) is
skipped and named. The check writes no result shards.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from omegaconf import DictConfig

from harness import config
from harness.config import ConfigError, checks, usage
from harness.config.ranks import external_rank, num_servers, num_workers
from harness.launch import leftovers
from harness.launch.launcher import check_launcher, launch
from harness.launch.process import exit_now

ENTRY = "harness.measure.preflight"  # the environment section, on every rank
VERIFY_STEPS = 2
STOPPED = (130, 143)  # the launcher got SIGINT / SIGTERM: the check stops
FAILED_RUN = re.compile(r"ddlbench: run \S+ failed: (.*)")
DIFF = re.compile(r"max_abs_diff=\S+ max_rank_diff=\S+")


# -- The command: plan every launch, run them, summarize ------------------------------------

@dataclass
class Plan:
    """What the check will launch, decided identically by every process before any starts."""

    environment: DictConfig                                   # the environment check's run
    methods: dict[str, DictConfig | str] = field(default_factory=dict)  # config or 'why not'
    skipped: dict[str, str] = field(default_factory=dict)     # not runnable in this launch


def split_methods(argv: list[str]) -> tuple[list[str], list[str]]:
    """The methods to check (`method=a,b`, default all of conf/method/) and the rest."""
    known = config.choices("method")
    given = [a.split("=", 1)[1] for a in argv if a.startswith("method=")]
    names = [m.strip() for value in given for m in value.split(",")] or known
    for name in names:
        if name not in known:
            raise ConfigError(f"method {name!r} is unknown; choose one of: {', '.join(known)}")
    return list(dict.fromkeys(names)), [a for a in argv if not a.startswith("method=")]


def plan(argv: list[str]) -> Plan:
    """Load each method's verify config. Raises ConfigError (bad input) when the
    overrides are a sweep or no method's config can run the environment check."""
    checks.used_by("harness.check", argv)
    names, rest = split_methods(argv)
    if len(config.expand(rest)) > 1:
        raise ConfigError("harness.check checks one cluster configuration; drop the comma "
                          "lists and sweeps from the overrides (method=a,b is the exception)")
    loaded: dict[str, DictConfig | str] = {}
    skipped: dict[str, str] = {}
    for name in names:
        try:
            loaded[name] = config.load([f"verify.steps={VERIFY_STEPS}", *rest, f"method={name}"])
        except ConfigError as exc:
            loaded[name] = str(exc)
            continue
        try:
            check_launcher(loaded[name])
        except ConfigError:  # it loads, but needs another number of processes
            skipped[name] = skip_reason(loaded[name])
    runnable = [n for n in names if n not in skipped and not isinstance(loaded[n], str)]
    if not runnable:
        first = loaded[names[0]]
        raise ConfigError(first if isinstance(first, str) else skipped[names[0]])
    # The environment check covers parameter servers when a checked method has them.
    first = next((n for n in runnable if num_servers(loaded[n])), runnable[0])
    return Plan(environment=loaded[first], methods=loaded, skipped=skipped)


def skip_reason(cfg: DictConfig) -> str:
    ext = external_rank() or {"world_size": "?"}
    need = num_workers(cfg) + num_servers(cfg)
    return (f"needs {need} processes ({describe(cfg)}), the launcher started "
            f"{ext['world_size']}; start {need} to check it")


@contextlib.contextmanager
def captured(fds: tuple[int, ...]) -> Iterator[list[str]]:
    """What is written to the file descriptors `fds` meanwhile, this process's and its
    children's, as one text appended to the yielded list when the block ends."""
    out: list[str] = []
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(fd) for fd in fds]
    with tempfile.TemporaryFile() as tmp:
        try:
            for fd in fds:
                os.dup2(tmp.fileno(), fd)
            yield out
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip(fds, saved):
                os.dup2(copy, fd)
                os.close(copy)
            tmp.seek(0)
            out.append(tmp.read().decode(errors="replace"))


def why_failed(code: int, log: str, cfg: DictConfig) -> str:
    """One line: verify's verdict on the parameters, else a failed group, else the
    launcher's cause, else the exit code."""
    diff = DIFF.search(log)
    if code == 1 and diff:
        return (f"{diff.group(0)}: beyond verify.atol={cfg.verify.atol:g}/"
                f"verify.rtol={cfg.verify.rtol:g}, or the ranks differ")
    if group := re.search(r"^group .*: FAILED .*$", log, re.M):
        return group.group(0)
    if cause := FAILED_RUN.search(log):
        return cause.group(1).strip()
    return f"exit code {code} (its errors are above)"


def run_one(cfg: DictConfig, *, entry: str, echo: bool) -> tuple[int, str, str]:
    """Launch `entry` on `cfg`'s cluster: (exit code, its captured output, '' or why it
    failed). `echo`: show the output as it is."""
    # Under torchrun/srun a failing rank ends its process at once: its errors must reach
    # stderr, not a file nobody reads.
    with captured((1, 2) if external_rank() is None else (1,)) as out:
        code, _ = launch(cfg, entry=entry)
    log = "".join(out)
    if echo and log:
        print(log.rstrip("\n"), flush=True)
    return code, log, "" if code == 0 else why_failed(code, log, cfg)


def describe(cfg: DictConfig) -> str:
    workers, servers = num_workers(cfg), num_servers(cfg)
    return (f"{workers} worker{'s' * (workers != 1)}"
            + (f" + {servers} server{'s' * (servers != 1)}" if servers else ""))


def verify_method(name: str, cfg: DictConfig, *, say: Callable[[str], None]
                  ) -> tuple[int, str]:
    """One method's `harness.verify`: its exit code and verdict, 'ok (<diffs>,
    <seconds>)' or 'FAILED <why>'."""
    start = time.monotonic()
    code, log, error = run_one(cfg, entry="harness.measure.verify", echo=False)
    diff = DIFF.search(log)
    took = f"{time.monotonic() - start:.1f} s"
    verdict = f"FAILED {error}" if code else f"ok ({diff.group(0) + ', ' if diff else ''}{took})"
    say(f"{name} ({describe(cfg)}): {verdict}")
    if code and log:  # the whole story, where `harness.verify` itself would have told it
        print(f"---- {name}: output of harness.verify ----\n{log.rstrip()}\n----",
              file=sys.stderr, flush=True)
    return code, verdict


def check_methods(p: Plan, *, say: Callable[[str], None]) -> tuple[dict[str, str], int | None]:
    """Every method's verdict ('ok ...', 'FAILED ...', 'skipped: ...') and, when a
    launcher was stopped (Ctrl-C, SIGTERM), its exit code (the check stops there)."""
    verdicts: dict[str, str] = {}
    for name, cfg in p.methods.items():
        if name in p.skipped or isinstance(cfg, str):
            verdicts[name] = f"skipped: {p.skipped[name]}" if name in p.skipped else f"FAILED {cfg}"
            say(f"{name}: {verdicts[name]}")
            continue
        code, verdicts[name] = verify_method(name, cfg, say=say)
        if code in STOPPED:
            return verdicts, code
    return verdicts, None


def clean(argv: list[str]) -> int:
    """`--clean`: remove what killed runs left behind (harness.launch.leftovers), say what."""
    if argv != ["--clean"]:
        print("ddlbench: error: --clean takes no other arguments; run python -m harness.check "
              "--clean alone", file=sys.stderr)
        return 2
    removed = leftovers.clean()
    print(f"ddlbench: {leftovers.say_cleaned(removed) or 'nothing left behind by killed runs'}")
    return 0


def main(argv: list[str]) -> int:
    if usage.answer(argv, __doc__):  # -h, --help: the help, and nothing else
        return 0
    if "--clean" in argv:
        return clean(argv)
    try:
        p = plan(argv)
    except ConfigError as exc:
        print(f"ddlbench: error: {exc}", file=sys.stderr)
        return 2
    ext = external_rank()
    say = print if ext is None or ext["rank"] == 0 else (lambda *args, **kwargs: None)
    say(f"ddlbench preflight: {describe(p.environment)}, model {p.environment.model.name}, "
        f"device {p.environment.cluster.device}, backend {p.environment.cluster.backend}",
        flush=True)
    code, _, env_error = run_one(p.environment, entry=ENTRY, echo=True)
    if code in STOPPED:
        return code
    say(f"\n== methods: harness.verify of each, {p.environment.verify.steps} steps, on this "
        "cluster", flush=True)
    verdicts, stopped = check_methods(p, say=lambda text: say(text, flush=True))
    if stopped:
        return stopped
    say("\n== summary")
    say(f"environment: {'FAILED ' + env_error if env_error else 'ok'}")
    for name, verdict in verdicts.items():
        say(f"{name}: {verdict.split(' (')[0] if verdict.startswith('ok') else verdict}")
    failed = bool(env_error) + sum(v.startswith("FAILED") for v in verdicts.values())
    skipped = f"; {len(p.skipped)} skipped" if p.skipped else ""
    say(f"{failed} check(s) failed{skipped}" if failed else f"every check passed{skipped}",
        flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
