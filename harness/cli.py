"""`ddlbench <command> [arguments]`: every command of the harness under one name.

    ddlbench run model=bert_tiny method=ddp cluster.workers_per_node=2
    ddlbench report results_dir=results out_dir=plots
    ddlbench --help                 # the commands; ddlbench <command> --help: one of them
    ddlbench help run               # the same as ddlbench run --help

`ddlbench <command> ...` is `python -m harness.<command> ...`, run the same way (the
module as __main__), so it behaves, exits and stops on Ctrl-C exactly as that does.
"""

from __future__ import annotations

import difflib
import runpy
import sys

from harness.config import usage as help_of

COMMANDS = {  # name: (module, what it does)
    "run": ("harness.run", "benchmark one configuration, or a sweep"),
    "verify": ("harness.verify", "check a method is lossless against one process"),
    "check": ("harness.check", "preflight of a cluster; --clean removes what killed runs left"),
    "plan": ("harness.plan", "print a method's plan"),
    "simulate": ("harness.simulate", "predict a sweep"),
    "report": ("harness.report.__main__", "draw the figures and tables"),
    "submit": ("harness.submit", "submit a sweep as a Slurm job array"),
    "microbench": ("harness.microbench", "measure the network"),
    "methodbench": ("harness.methodbench", "measure every method against ddp (make bench)"),
    "install_horovod": ("harness.install_horovod", "build Horovod into this venv (make horovod)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return ("usage: ddlbench <command> [arguments]   (ddlbench <command> --help: its own)\n\n"
            "commands:\n" + "\n".join(lines) + "\n\ne.g. ddlbench run model=bert_tiny "
            "method=ddp cluster.workers_per_node=2")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["help"] and argv[1:]:  # help run: run --help
        argv = [argv[1], "--help"]
    if not argv or help_of.asked(argv[:1]):
        help_of.say(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        print(f"ddlbench: error: {name!r} is not a command; {hint}choose one of: "
              f"{', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    sys.argv = [f"ddlbench {name}", *rest]
    try:
        runpy.run_module(COMMANDS[name][0], run_name="__main__", alter_sys=True)
    except SystemExit as done:  # the command's own exit code
        code = done.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
