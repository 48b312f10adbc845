"""What sbatch accepts: every `cluster.slurm.*` value checked before a script is rendered,
and the quoting of the values that reach a `#SBATCH` line.

A value with a newline would end its `#SBATCH` line and start a shell command (and sbatch
stops reading directives at the first command, silently dropping the rest), so names,
times and counts are checked against Slurm's own forms, and a free-form value (a path, an
`extra` option's argument) is quoted the way sbatch reads a directive: inside double
quotes, with backslash and double quote escaped. Shell lines of the script never hold a
user's value as text: they read quoted variables and files (harness/launch/slurm.py).
`setup` is the one key that is shell by design: its lines run as written, after every
directive.
"""

from __future__ import annotations

import re

from omegaconf import DictConfig

from harness.config.schema import ConfigError

NAME = r"[A-Za-z0-9_][A-Za-z0-9_.\-]*"
# partition (a comma list), account, qos and reservation names; constraint expressions
NAMES = {
    "partition": (rf"{NAME}(,{NAME})*", "a partition name or a comma list, e.g. gpu or gpu,debug"),
    "account": (NAME, "an account name, e.g. proj123"),
    "qos": (NAME, "a QOS name, e.g. normal"),
    "reservation": (rf"{NAME}(,{NAME})*", "a reservation name, e.g. maint"),
    "constraint": (r"[A-Za-z0-9_.\-&|,\[\]*():!]+", "a feature expression, e.g. a100 or "
                   "a100&ib"),
}
# sbatch's --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds; or no limit
TIME = re.compile(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|UNLIMITED|INFINITE", re.I)
COUNTS = {"cpus_per_task": (1, "null (Slurm's default) or a count >= 1"),
          "gpus_per_node": (0, "null (one per worker), 0 (CPU nodes) or more"),
          "max_parallel": (0, "0 (no limit) or a count >= 1"),
          "servers_per_node": (1, "a count >= 1")}
# what the script renders from keys of its own: an `extra` option must not set them again
OWN = {"array": None, "nodes": None, "ntasks-per-node": None, "ntasks": None,
       "job-name": None, "output": "jobs_dir", "partition": "partition", "account": "account",
       "time": "time", "qos": "qos", "constraint": "constraint", "reservation": "reservation",
       "gpus-per-node": "gpus_per_node", "cpus-per-task": "cpus_per_task", "mem": "mem"}
SHORT = {"a": "array", "N": "nodes", "n": "ntasks", "J": "job-name", "o": "output",
         "p": "partition", "A": "account", "t": "time", "q": "qos", "C": "constraint",
         "c": "cpus-per-task"}
OPTION = re.compile(r"(--[A-Za-z][A-Za-z0-9-]*|-[A-Za-z])(?:[= ](.*))?", re.S)
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_values(slurm: DictConfig) -> None:
    """Every `cluster.slurm.*` value is one sbatch accepts; else ConfigError naming the
    key, the value and the fix."""
    for key, (pattern, form) in NAMES.items():
        value = slurm.get(key)
        if value is not None and not re.fullmatch(pattern, str(value)):
            raise ConfigError(f"cluster.slurm.{key}={str(value)!r} is invalid; use {form}, "
                              "or null for Slurm's default")
    if slurm.time is not None and not TIME.fullmatch(str(slurm.time)):
        raise ConfigError(f"cluster.slurm.time={str(slurm.time)!r} is invalid; use Slurm's "
                          "--time forms: minutes (90), hours:minutes:seconds (01:30:00), "
                          "days-hours:minutes:seconds (1-12:00:00), or UNLIMITED")
    for key, (least, form) in COUNTS.items():
        value = slurm.get(key)
        if value is not None and value < least:
            raise ConfigError(f"cluster.slurm.{key}={value} is invalid; use {form}")
    if slurm.mem is not None and not re.fullmatch(r"\d+[KMGT]?", str(slurm.mem), re.I):
        raise ConfigError(f"cluster.slurm.mem={str(slurm.mem)!r} is invalid; use Slurm's "
                          "--mem form: a size in MB or with a K, M, G or T suffix (64G)")
    for option in slurm.extra:
        check_extra(str(option))
    for key in ("jobs_dir", "template"):
        if CONTROL.search(str(slurm[key])):
            raise ConfigError(f"cluster.slurm.{key}={str(slurm[key])!r} holds a control "
                              "character (a newline?); give a plain path")


def check_extra(option: str) -> None:
    """One `extra` item: a single sbatch option (`--name=value`, `--flag`, `-X value`),
    on one line, that no key of cluster.slurm already sets."""
    found = OPTION.fullmatch(option)
    if found is None or CONTROL.search(option):
        raise ConfigError(f"cluster.slurm.extra item {option!r} is invalid; give one sbatch "
                          "option per item, on one line, e.g. --exclusive or --comment=run 1")
    name = found.group(1).lstrip("-")
    name = SHORT.get(name, name) if len(name) == 1 else name
    if name in OWN:
        key = OWN[name]
        fix = (f"set cluster.slurm.{key} instead" if key else
               "the script sets it from the configuration; remove it")
        raise ConfigError(f"cluster.slurm.extra item {option!r} sets --{name}, which "
                          f"harness.submit renders itself; {fix}")


def quote(text: str) -> str:
    """`text` as a `#SBATCH` line reads it back: plain characters as they are, anything
    else double-quoted with backslash and double quote escaped."""
    if CONTROL.search(text):  # refused by check_values; never let one through to a script
        raise ConfigError(f"{text!r} holds a control character; it cannot be a directive")
    if re.fullmatch(r"[A-Za-z0-9_.,:/+%@=&|\[\]*()!-]+", text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def directive(name: str, value: object) -> str:
    """`--name=<value>`, the value quoted for a `#SBATCH` line."""
    return f"--{name}={quote(str(value))}"


def extra_directive(option: str) -> str:
    """A checked `extra` item as a directive, its argument quoted."""
    flag, value = OPTION.fullmatch(option).groups()
    if value is None:
        return flag
    return f"{flag}{'=' if flag.startswith('--') else ' '}{quote(value)}"
