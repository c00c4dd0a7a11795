"""``%%gpulab_train``: run the cell as the chief's program of a distributed training job.

    %load_ext gpulab.extensions
    %%gpulab_train --strategy parameter-server --ps 1 --workers 2 --gpus 1
    from gpulab.extensions import runtime
    strategy = runtime.strategy()
    ...

Flags: ``--name`` (default ``nb-<date>-<time>-<xyz>``), ``--strategy`` (``parameter-server``
or ``multi-worker-mirrored``), ``--ps``, ``--workers``, ``--gpus``/``--cpu``/``--memory``
(each worker's), ``--image`` (Kubernetes), ``--max-runtime`` (seconds), ``--retries``,
``--env NAME=VALUE`` (repeat), ``--file PATH`` (repeat: a file, e.g. a module of the
notebook's folder, sent with the cell and placed beside it, so that the cell imports it),
``--evaluator``, ``--no-view``; what follows ``--`` is passed
to the program as its arguments. A bad flag or a refusal of the service is one line in the
cell, never a traceback. The job's `JobView` is displayed; the `Job` is in ``_gpulab_job``.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from . import jobmodel as jm


class ArgError(ValueError):
    """A bad ``%%gpulab_train`` line; the message is one line for the person."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ArgError(f"%%gpulab_train: {message} (see %%gpulab_train --help)")

    def exit(self, status=0, message=None):
        raise ArgError(message or "")


def _parser() -> _Parser:
    p = _Parser(prog="%%gpulab_train", add_help=False, allow_abbrev=False,
                description="Run this cell as a distributed TensorFlow training job.")
    p.add_argument("--help", "-h", action="store_true", help="show this help")
    p.add_argument("--name", help="job name: lower-case letters, digits and '-' (default: new)")
    p.add_argument("--strategy", choices=jm.STRATEGIES, default="parameter-server")
    p.add_argument("--ps", type=int, default=1, help="parameter servers (parameter-server)")
    p.add_argument("--workers", type=int, default=1, help="workers")
    p.add_argument("--gpus", type=int, default=0, help="GPUs of each worker")
    p.add_argument("--cpu", type=float, default=None, help="CPUs of each worker")
    p.add_argument("--memory", default=None, help="memory of each worker, e.g. 8Gi")
    p.add_argument("--image", default=None, help="container image (Kubernetes)")
    p.add_argument("--max-runtime", type=int, default=None, help="seconds, then it is stopped")
    p.add_argument("--retries", type=int, default=None, help="restarts of failed replicas")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable of every replica (repeat)")
    p.add_argument("--file", action="append", default=[], metavar="PATH", dest="files",
                   help="a file sent with the cell and placed beside it, importable, e.g. "
                   "a module of the notebook's folder (repeat)")
    p.add_argument("--evaluator", action="store_true", help="add an evaluator replica")
    p.add_argument("--no-view", action="store_true", help="do not display the JobView")
    p.add_argument("args", nargs="*", help="after --: the program's arguments")
    return p


def usage() -> str:
    return _parser().format_help()


def parse_train_line(line: str, cell: str) -> tuple[dict, argparse.Namespace]:
    """(the job spec, the parsed flags) of ``%%gpulab_train <line>`` over ``cell``;
    `ArgError` with one line for the person when something is wrong."""
    try:
        words = shlex.split(line)
    except ValueError as e:
        raise ArgError(f"%%gpulab_train: cannot read the flags: {e}") from None
    ns = _parser().parse_args(words)
    if ns.help:
        return {}, ns
    env = {}
    for item in ns.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ArgError(f"%%gpulab_train: --env takes NAME=VALUE, got {item!r}")
        env[key] = value
    name = ns.name or jm.unique_name()
    problems = jm.check_form(name=name, strategy=ns.strategy, ps=ns.ps, workers=ns.workers,
                             gpus=ns.gpus, cpu=ns.cpu, memory=ns.memory, code=cell)
    if ns.max_runtime is not None and ns.max_runtime <= 0:
        problems.append("--max-runtime must be a positive number of seconds.")
    if ns.retries is not None and ns.retries < 0:
        problems.append("--retries cannot be negative.")
    if problems:
        raise ArgError("%%gpulab_train: " + " ".join(problems))
    try:
        files = jm.read_files(ns.files)
    except ValueError as e:
        raise ArgError(f"%%gpulab_train: --file: {e}") from None
    spec = jm.build_spec(name=name, strategy=ns.strategy, ps=ns.ps, workers=ns.workers,
                         gpus=ns.gpus, cpu=ns.cpu, memory=ns.memory, source=cell, args=ns.args,
                         env=env, max_runtime=ns.max_runtime, retries=ns.retries,
                         image=ns.image, evaluator=ns.evaluator, files=files)
    return spec, ns


def gpulab_train(line: str, cell: str, client=None, shell=None):
    """The cell magic: submit the cell, display its `JobView`; errors as one line."""
    from .client import Client, GpulabError

    try:
        spec, ns = parse_train_line(line, cell)
    except ArgError as e:
        print(str(e), file=sys.stderr)
        return None
    if ns.help:
        print(usage())
        return None
    client = client or Client()
    try:
        job = client.submit(spec)
    except GpulabError as e:
        print(f"gpulab: {e.message}", file=sys.stderr)
        return None
    if shell is not None:
        shell.user_ns["_gpulab_job"] = job
    if not ns.no_view:
        from IPython.display import display

        from .widgets import JobView

        display(JobView(job, client))
    else:
        print(f"gpulab: job {job.name} submitted: {job.view['state']}")
    return None


def load_ipython_extension(ipython) -> None:
    """``%load_ext gpulab.extensions``: registers ``%%gpulab_train``."""

    def magic(line, cell):
        return gpulab_train(line, cell, shell=ipython)

    magic.__doc__ = usage()
    ipython.register_magic_function(magic, magic_kind="cell", magic_name="gpulab_train")
