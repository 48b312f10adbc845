"""Every command's `--help`: its module docstring, laid out for a person.

A command's docstring opens with "`<usage>`: <purpose>" and shows its examples as
indented lines. `answer` prints it, with the choices of every config group for the
commands that compose a configuration, when the arguments ask for help: `-h`, `--help`
and the spellings people also type (`-help`, `--h`, `-?`, or `help` first). The command
then returns 0 before it reads anything else, starts anything or writes anything.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import textwrap
from collections.abc import Sequence

from harness.config.compose import choices
from harness.config.schema import GROUPS

FLAGS = ("-h", "--help", "-help", "--h", "-?")
WIDTH = 92


def asked(argv: Sequence[str]) -> bool:
    """Whether `argv` asks for help: one of FLAGS anywhere, or `help` as the first word."""
    return bool(argv) and (argv[0] == "help" or any(a in FLAGS for a in argv))


def _parts(doc: str) -> tuple[str, str, str]:
    """(usage, purpose, the rest) of a command's docstring."""
    head, _, body = textwrap.dedent(doc.replace("``", "`")).strip().partition("\n\n")
    usage, _, purpose = " ".join(head.split()).partition("`: ")
    return usage.strip("`"), purpose[:1].upper() + purpose[1:], textwrap.dedent(body).strip("\n")


def description(doc: str) -> str:
    """The purpose and the rest of a command's docstring: the description of a command
    whose argparse parser writes the usage line (argparse.RawDescriptionHelpFormatter)."""
    _, purpose, body = _parts(doc)
    return f"{purpose}\n\n{body}"


def text(doc: str, *, groups: bool = True) -> str:
    """The help of the command documented by `doc`: a usage line (also as `ddlbench
    <command>`), its purpose, the rest of the docstring, and with `groups` the names each
    config group takes."""
    usage, purpose, body = _parts(doc)
    module = re.match(r"python -m harness\.(\w+)", usage)
    also = f"\n   or: ddlbench {module.group(1)}{usage[module.end():]}" if module else ""
    lines = [f"usage: {usage}{also}", "", purpose, "", body]
    if groups:
        lines += ["", "Groups (key=<name>, a file of conf/<key>/), and any other key of "
                  "conf/bench.yaml as key=value:"]
        lines += [textwrap.fill(", ".join(choices(g)), WIDTH, initial_indent=f"  {g + '=':12}",
                                subsequent_indent=" " * 14) for g in GROUPS]
        lines += ["More: README.md, section Commands."]
    return "\n".join(lines)


def answer(argv: Sequence[str], doc: str | None, *, groups: bool = True) -> bool:
    """Print the command's help (`text` of `doc`) when `argv` asks for it; True: it did,
    and the command returns 0 now."""
    if not asked(argv):
        return False
    say(text(doc or "", groups=groups))
    return True


def say(help_text: str) -> None:
    """Print `help_text` to stdout, quietly when the reader stops early (`--help | head`)."""
    try:
        print(help_text, flush=True)
    except BrokenPipeError:  # the reader has what it wanted
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - Python flushes it at exit


class Parser(argparse.ArgumentParser):
    """argparse with bad input as every command has it: one line, exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"ddlbench: error: {message}; see {self.prog} --help\n")
