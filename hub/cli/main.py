"""The ``gpulab`` command line: the parser of every command and the dispatch to them.

Each command lives in its own module and adds its own sub-parser: ``up`` (`gpulab.hub.cli.up`),
``quota`` and ``usage`` (`gpulab.hub.cli.quota`), ``jobs`` (`gpulab.hub.cli.jobs`),
``config-reference`` (`gpulab.hub.cli.docs`), ``service`` (`gpulab.hub.cli.service`). What
they share (the hub options, the service's client, errors, the table) is in
`gpulab.hub.cli.common`; only this module knows them all.
"""

from __future__ import annotations

import argparse
import os
import sys

from gpulab.hub.cli.common import EXIT_USAGE, add_global_options, apply_global_options, fail
from gpulab.hub.cli.docs import config_reference
from gpulab.hub.cli.jobs import add_jobs_parser, cmd_jobs
from gpulab.hub.cli.quota import add_quota_parsers, cmd_keep, cmd_quota, cmd_usage
from gpulab.hub.cli.service import add_service_parser, cmd_service
from gpulab.hub.cli.up import add_up_parser, cmd_up


def cmd_config_reference(args) -> int:
    sys.stdout.write(config_reference(build_parser()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpulab", description="gpulab: a JupyterHub for shared GPUs")
    parser.add_argument("--version", action="version", version=f"gpulab {version()}",
                        help="print gpulab's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_up_parser(sub)
    sub.add_parser("config-reference", help="print the configuration reference (Markdown)")
    add_global_options(parser)  # --url, --token, --json also before the command
    add_quota_parsers(sub)
    add_jobs_parser(sub)
    add_service_parser(sub)
    return parser


COMMANDS = {"up": cmd_up, "config-reference": cmd_config_reference, "quota": cmd_quota,
            "usage": cmd_usage, "jobs": cmd_jobs, "service": cmd_service, "keep": cmd_keep}


def version() -> str:
    """The installed distribution's version (``0.1.0``); ``unknown`` when run from a tree
    that is not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("gpulab")
    except PackageNotFoundError:
        return "unknown"


#: the exit status when the reader of standard output went away (``gpulab … | head``): what a
#: shell reports for a program killed by SIGPIPE, 128 + 13
EXIT_PIPE = 141


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status. When whoever reads standard output has gone
    (``gpulab jobs show x | head -1``), the command ends quietly with `EXIT_PIPE`, as Python's
    documentation on SIGPIPE advises: no traceback, and standard output pointed at /dev/null
    so that the interpreter's last flush at exit finds nothing to complain about."""
    try:
        try:
            return run(argv)
        finally:  # (also after --version or -h) a closed pipe shows here, not at exit
            sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_PIPE


def run(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = apply_global_options(args)
    if problem:
        return fail(problem)
    command = COMMANDS.get(args.command)
    if command is None:
        parser.print_help()
        return EXIT_USAGE
    return command(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
