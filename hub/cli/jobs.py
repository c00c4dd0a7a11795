"""``gpulab jobs``: submit, list, show, follow the logs of and stop training jobs.

The jobs API the notebook extension uses (``/services/gpulab/api/v1/jobs``), through the same
client (`gpulab.extensions.client.Client` and `Job`: requests, errors, log following), with
the token and address of ``gpulab quota`` (`gpulab.hub.cli.common`: ``--token``/
``$GPULAB_TOKEN``/``$JUPYTERHUB_API_TOKEN``, ``--url``/``$GPULAB_URL``, before or after the
command: ``gpulab --url X jobs list``). A spec
comes from a YAML (or JSON) file, from flags, or both: flags override the file's fields. The
service checks the spec; its message names the bad field. ``show`` gives times as local date and
time with how long the job waited or ran, and a line per restart of a replica (which,
when, why); ``--json`` keeps the API's Unix times. ``logs`` prints a log as a terminal shows
it (a progress bar redrawn with ``\\r``/``\\b`` is one line, colour codes gone; ``--raw``: as
written).

    gpulab jobs submit --name digits --strategy parameter-server --ps 1 --workers 2 \\
        --gpus 1 --script examples/digits_parameter_server.py -f
    gpulab jobs submit --name mnist --strategy multi-worker-mirrored --workers 2 \\
        --source-file main.py --source-file mnist_setup.py     (or: --source-file folder/)
    gpulab jobs submit spec.yaml
    gpulab jobs list [--all]
    gpulab jobs show digits
    gpulab jobs logs digits [chief-0] [-f] [--raw]
    gpulab jobs stop digits
    gpulab jobs export --format tfjob spec.yaml --user ann > tfjob.yaml   (no hub needed)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from gpulab.extensions.client import GpulabError, Job
from gpulab.extensions.client import lead_replica as lead_of_view
from gpulab.extensions.contract import STRATEGIES, lead_replica
from gpulab.extensions.joblog import restart_lines
from gpulab.extensions.jobmodel import queue_text

from gpulab.hub.cli.common import (EXIT_USAGE, add_global_options, common, fail_api, hub_client,
                                   table)


def add_jobs_parser(sub) -> None:
    j = sub.add_parser("jobs", help="distributed TensorFlow training jobs")
    add_global_options(j, "group")
    js = j.add_subparsers(dest="action", metavar="ACTION")

    s = js.add_parser("submit", help="submit a job (a YAML spec and/or flags)",
                      description="Submit a training job. Flags override the spec file.")
    _spec_arguments(s)
    s.add_argument("-f", "--follow", action="store_true",
                   help="then follow the lead replica's log until the job ends")
    common(s)

    e = js.add_parser("export", help="render a job spec for another system (no hub needed)",
                      description="Print the job as a Kubeflow TFJob (kubeflow.org/v1) for "
                      "clusters that run the training operator: chief, ps, workers, "
                      "cleanPodPolicy Running. Code given with --source-file goes in a "
                      "ConfigMap printed first.")
    _spec_arguments(e)
    e.add_argument("--format", choices=("tfjob",), required=True, help="what to render")
    e.add_argument("--namespace", help="namespace (default gpulab-<user>)")
    e.add_argument("--user", dest="export_user", metavar="USER",
                   help="whose job: labels and shared folder (default: $USER)")
    e.add_argument("--default-image", default="gpulab/singleuser:latest",
                   help="image when the spec names none (default gpulab/singleuser:latest)")
    e.add_argument("--gpu-model", help="GPU model node label value, e.g. NVIDIA-H100")
    e.add_argument("--shared-mount", default="/gpulab/shared",
                   help="where the shared storage is mounted (default /gpulab/shared)")
    e.add_argument("--nfs", metavar="SERVER:/PATH",
                   help="mount the shared storage from this NFS export (default: none)")

    ls = js.add_parser("list", help="my jobs (admins: --all or --user)")
    ls.add_argument("--all", action="store_true", help="everyone's jobs (admins)")
    ls.add_argument("--user", help="another user's jobs (admins)")
    common(ls)
    for name, text in (("show", "a job's state and replicas"), ("stop", "stop a job")):
        p = js.add_parser(name, help=text)
        p.add_argument("name")
        p.add_argument("--user", help="another user's job (admins)")
        common(p)
    lg = js.add_parser("logs", help="a replica's log")
    lg.add_argument("name")
    lg.add_argument("replica", nargs="?", help="e.g. chief-0, ps-0, worker-1 "
                    "(default: the chief, or worker-0)")
    lg.add_argument("-f", "--follow", action="store_true", help="follow until the job ends")
    lg.add_argument("--raw", action="store_true",
                    help="the log as the program wrote it (every \\r/\\b redraw of a progress "
                    "bar, colour codes); by default as a terminal shows it")
    lg.add_argument("--user", help="another user's job (admins)")
    common(lg)


def _spec_arguments(s) -> None:
    """The arguments that make a job spec (``submit``, ``export``)."""
    s.add_argument("spec", nargs="?", help="YAML or JSON file with the job spec")
    s.add_argument("--name", help="job name: lower-case letters, digits and '-'")
    s.add_argument("--strategy", choices=STRATEGIES)
    s.add_argument("--ps", type=int, help="parameter servers (parameter-server)")
    s.add_argument("--workers", type=int, help="workers")
    s.add_argument("--evaluator", action="store_true", help="add an evaluator replica")
    s.add_argument("--gpus", type=int, help="GPUs of each worker")
    s.add_argument("--cpu", type=float, help="CPUs of each worker")
    s.add_argument("--memory", help="memory of each worker, e.g. 8Gi")
    code = s.add_mutually_exclusive_group()
    code.add_argument("--script", help="a .py file, relative to your folder on shared storage")
    code.add_argument("--source-file", action="append", default=None, metavar="PATH",
                      help="a local file (or a folder: its .py files) whose text is sent as "
                      "the code; repeat it for a program of several files: the first file "
                      "named is the entry point (a folder's: main.py), the others go beside "
                      "it, importable")
    s.add_argument("--entry", metavar="NAME",
                   help="with several source files: the one to run (its file name), e.g. "
                   "train.py")
    s.add_argument("--arg", action="append", default=None, dest="args", metavar="ARG",
                   help="an argument for the program (repeat)")
    s.add_argument("--env", action="append", default=None, metavar="NAME=VALUE",
                   help="an environment variable for every replica (repeat)")
    s.add_argument("--max-runtime", type=int, help="seconds after which the job is stopped")
    s.add_argument("--retries", type=int, help="restarts of failed replicas (default 2)")
    s.add_argument("--image", help="container image (Kubernetes; admin-allowed list)")
    s.add_argument("--no-wait", dest="wait", action="store_false", default=None,
                   help="start now or be refused; by default a job whose GPUs are busy waits "
                        "in the queue (Queued) and starts by itself")
    s.add_argument("--priority", type=int, help="order among your own queued jobs "
                   "(-100..100, higher first; default 0; refused on a cluster queued by Kueue)")
    s.add_argument("--preemptible", action="store_true", default=None,
                   help="may borrow GPUs idle beyond your quota; stopped and queued again "
                        "(resuming from its checkpoint) when in-quota work needs them")


class UsageError(Exception):
    pass


def export_tfjob(args) -> str:
    """The spec of ``args`` as YAML: a Kubeflow TFJob (after a ConfigMap for ``source``)."""
    import getpass

    import yaml
    from kubespawner.slugs import safe_slug

    from gpulab.hub.jobs.spec import JobLimits, SpecError, parse_spec
    from gpulab.hub.cluster.kubeobjects import container_defaults
    from gpulab.hub.cluster.namespaces import DEFAULT_CONTAINER_LIMITS, DEFAULT_CONTAINER_REQUESTS
    from gpulab.hub.jobs.kubeobjects import (SOURCE_PROGRAM, Placement, make_source_configmap,
                                             make_tfjob, mount_source)

    raw = spec_from_args(args)
    try:
        spec = parse_spec(raw, JobLimits(allowed_images=(raw["image"],) if raw.get("image")
                                         else ()))
    except SpecError as e:
        raise UsageError(e.message) from None
    label = safe_slug(args.export_user or getpass.getuser(), max_length=48)
    ns = args.namespace or f"gpulab-{label}"
    root = args.shared_mount.rstrip("/")
    user_dir = f"{root}/users/{label}"
    shared = None
    if args.nfs:
        server, _, path = args.nfs.partition(":")
        if not server or not path.startswith("/"):
            raise UsageError(f"--nfs takes SERVER:/PATH, not {args.nfs!r}")
        shared = {"nfs": {"server": server, "path": path}}
    # gpulab's default container resources, as the hub gives its own replicas
    limits, requests = container_defaults(limits=DEFAULT_CONTAINER_LIMITS,
                                          requests=DEFAULT_CONTAINER_REQUESTS)
    tfjob = make_tfjob(spec, Placement(
        namespace=ns, user_label=label, image=spec.image or args.default_image,
        program=SOURCE_PROGRAM if spec.source is not None else f"{user_dir}/{spec.script}",
        job_dir=f"{user_dir}/jobs/{spec.name}", user_dir=user_dir, gpu_model=args.gpu_model,
        shared_volume=shared, shared_mount=root, user_subpath=f"users/{label}",
        datasets_subpath="datasets", container_limits=limits, container_requests=requests))
    docs = [tfjob]
    if spec.source is not None:
        for replica in tfjob["spec"]["tfReplicaSpecs"].values():
            mount_source(replica["template"]["spec"], job=spec.name)
        docs.insert(0, make_source_configmap(spec=spec, namespace=ns, user_label=label))
    return yaml.safe_dump_all(docs, sort_keys=False)


def spec_from_args(args) -> dict:
    """The job spec: the file's fields, then the flags over them."""
    spec: dict = {}
    if args.spec:
        import yaml

        try:
            loaded = yaml.safe_load(Path(args.spec).read_text())
        except OSError as e:
            raise UsageError(f"cannot read {args.spec}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise UsageError(f"{args.spec} is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise UsageError(f"{args.spec} must hold a mapping (name:, strategy:, …)")
        spec = loaded
    for key in ("name", "strategy", "script", "max_runtime", "retries", "image", "wait",
                "priority", "preemptible"):
        if getattr(args, key) is not None:
            spec[key] = getattr(args, key)
    replicas = dict(spec.get("replicas") or {})
    if args.strategy == "parameter-server" or spec.get("strategy") == "parameter-server":
        replicas.setdefault("chief", 1)
        replicas.setdefault("ps", 1)
    if args.ps is not None:
        replicas["ps"] = args.ps
    if args.workers is not None:
        replicas["worker"] = args.workers
    if args.evaluator:
        replicas["evaluator"] = 1
    if replicas:
        spec["replicas"] = replicas
    worker = dict((spec.get("resources") or {}).get("worker") or {})
    for key in ("gpus", "cpu", "memory"):
        if getattr(args, key) is not None:
            worker[key] = getattr(args, key)
    if worker:
        spec["resources"] = {**(spec.get("resources") or {}), "worker": worker}
    if args.source_file:
        spec["source"], files = read_source_files(args.source_file, args.entry)
        spec.pop("files", None)
        if files:
            spec["files"] = files
        spec.pop("script", None)
    elif args.entry:
        raise UsageError("--entry names one of the files given with --source-file")
    if args.args is not None:
        spec["args"] = args.args
    if args.env is not None:
        env = dict(spec.get("env") or {})
        for item in args.env:
            if "=" not in item:
                raise UsageError(f"--env takes NAME=VALUE, not {item!r}")
            k, v = item.split("=", 1)
            env[k] = v
        spec["env"] = env
    if not spec.get("name") or not spec.get("strategy"):
        raise UsageError("a job needs --name and --strategy (or a spec file that has them)")
    return spec


def read_source_files(paths: list[str], entry: str | None = None) -> tuple[str, dict[str, str]]:
    """(the entry point's text, ``{name: text}`` of the other files) from ``--source-file``
    paths: files, and folders standing for their ``.py`` files (not hidden ones, not
    subfolders). The entry point is the file named `entry`, else the first file named, else a
    folder's ``main.py`` (or its only ``.py`` file). Files travel by their own names; the
    service checks them (`gpulab.hub.jobs.spec.FILE_NAME_RE`)."""
    found: dict[str, Path] = {}
    first = None
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            members = sorted(p for p in path.iterdir()
                             if p.suffix == ".py" and not p.name.startswith(".") and p.is_file())
            if not members:
                raise UsageError(f"{raw} holds no .py files")
            if first is None:
                main = [p for p in members if p.name == "main.py"]
                first = (main or members)[0].name if main or len(members) == 1 else ""
        else:
            members = [path]
            if first is None:
                first = path.name
        for p in members:
            if p.name in found and found[p.name] != p:
                raise UsageError(f"two source files are named {p.name} ({found[p.name]} and "
                                 f"{p}); the files of a job go in one folder")
            found[p.name] = p
    name = entry or first
    if not name:
        raise UsageError(f"which file is the entry point? {paths[0]} has no main.py and "
                         f"several .py files: name one with --entry")
    if name not in found:
        raise UsageError(f"--entry {name}: not one of the source files "
                         f"({', '.join(sorted(found))})")
    texts = {}
    for n, p in found.items():
        try:
            texts[n] = p.read_text(encoding="utf-8")
        except OSError as e:
            raise UsageError(f"cannot read {p}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise UsageError(f"{p} is not UTF-8 text") from None
    return texts.pop(name), texts


def _duration(secs: float) -> str:
    secs = max(0, int(secs))
    return f"{secs // 3600}:{secs // 60 % 60:02d}:{secs % 60:02d}"


def _elapsed(job: dict) -> str:
    if not job.get("started_at"):
        return "-"
    return _duration((job.get("finished_at") or time.time()) - job["started_at"])


def local_time(ts: float) -> str:
    """A Unix time as this machine's local date and time, ``2026-12-04 14:05:31``."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def job_times(job: dict, now: float | None = None) -> list[str]:
    """When the job was created, started and finished (local time), with how long it waited
    or ran: ``started  2026-12-04 14:05:33, running for 0:05:12``."""
    now = time.time() if now is None else now
    created, started, finished = (job.get(k) for k in ("created_at", "started_at", "finished_at"))
    lines = []
    if created:
        lines.append(f"created  {local_time(created)}")
    if started:
        lines.append(f"started  {local_time(started)}" +
                     ("" if finished else f", running for {_duration(now - started)}"))
    elif not finished:
        lines.append("started  not yet" +
                     (f", waiting for {_duration(now - created)}" if created else ""))
    if finished:
        lines.append(f"finished {local_time(finished)}" +
                     (f", ran {_duration(finished - started)}" if started else ", never started"))
    return lines


def kind_words(job: dict) -> str:
    """What the job is, for its STRATEGY column: its strategy, or ``cluster`` for parameter
    servers and workers held for a notebook kernel (issue 38)."""
    return "cluster" if job.get("kind") == "cluster" else job["strategy"]


def state_words(job: dict, now: float | None = None) -> str:
    """``Running``, or for a queued job where it stands: ``Queued (2nd in line · starts in
    about 12 min (14:05))``."""
    waiting = queue_text(job, now)
    return f"{job['state']} ({waiting})" if waiting else job["state"]


def progress_words(p: dict | None, now: float | None = None) -> str:
    """The job's last progress line in words: ``progress: step 40/100 (loss 0.31), reported
    2026-12-04 14:07:00 (12 s ago)``; the runtime's ``time`` (a Unix time) as local time."""
    if not p or "step" not in p:
        return ""
    total = f"/{p['total']}" if p.get("total") else ""
    metrics = ", ".join(f"{k} {v}" for k, v in p.items() if k not in ("step", "total", "time"))
    line = f"progress: step {p['step']}{total}" + (f" ({metrics})" if metrics else "")
    at = p.get("time")
    if isinstance(at, (int, float)) and not isinstance(at, bool) and at > 0:
        now = time.time() if now is None else now
        line += f", reported {local_time(at)}"
        if now >= at:
            line += f" ({_duration(now - at)} ago)"
    return line


def print_job(job: dict, now: float | None = None) -> None:
    print(f"{job['name']} ({job['user']}): {state_words(job, now)}: {job['reason']}")
    if job.get("kind") == "cluster":
        print(f"cluster held for a notebook kernel (parameter-server), {job['gpus']} GPU(s), "
              f"folder {job['job_dir']}")
        for role, addresses in (job.get("cluster") or {}).items():
            print(f"{role}: {', '.join(addresses)}")
    else:
        print(f"strategy {job['strategy']}, {job['gpus']} GPU(s), folder {job['job_dir']}")
    for line in job_times(job, now):
        print(line)
    line = progress_words(job.get("progress"), now)
    if line:
        print(line)
    print(table([[r["name"], r["state"], r["restarts"], r["exit_code"],
                  ",".join(map(str, r["devices"])) or "-", r["reason"]] for r in job["replicas"]],
                ["REPLICA", "STATE", "RESTARTS", "EXIT", "GPUS", "REASON"]))
    for r in job["replicas"]:  # while it runs: how busy its GPUs are (NVML)
        for u in r.get("usage") or ():
            print(f"{r['name']}: {u['text']}")
    for u in job.get("usage") or ():  # Kubernetes: by pod, from the DCGM exporter
        print(f"{u.get('pod') or job['name']}: {u['text']}")
    lines = restart_lines(job)
    if lines:
        print("restarts:")
        for line in lines:
            print(f"  {line}")


def follow_logs(job: Job, replica: str, follow: bool, raw: bool = False) -> int:
    """Print a replica's log as a terminal shows it (``raw``: as written): with `follow`,
    finished lines as they come until the job has ended (on a terminal the line being
    redrawn, a progress bar, shows in place meanwhile); else the log so far."""
    out = sys.stdout
    if not follow:
        text = job.logs(replica, raw=raw)
        out.write(text if raw or not text or text.endswith("\n") else text + "\n")
        out.flush()
        return 0
    live = not raw and out.isatty()
    open_line = ""
    for finished, open_line in job.follow_lines(replica, raw=raw):
        if live:  # the bar in place: back to the line's start, erase it, draw it again
            out.write("\r\x1b[K" + finished + open_line[:max(1, _width() - 1)])
        else:
            out.write(finished)
        out.flush()
    if open_line and not raw:
        out.write(("\r\x1b[K" if live else "") + open_line + "\n")
        out.flush()
    return 0


def _width() -> int:
    import shutil

    return shutil.get_terminal_size().columns


#: answers that mean the hub (or its proxy, or the gpulab service behind it) is not there
#: now, rather than that the request was wrong
HUB_GONE = (502, 503, 504)


def hub_gone(e: GpulabError, args, name: str, replica: str | None = None) -> int:
    """Following a job's log ended because the hub stopped answering: the job itself goes on
    (the hub re-adopts it when it starts again), so say so, and how to follow it again.
    Other errors are printed as any other (`fail_api`)."""
    if e.kind != "unreachable" and e.status not in HUB_GONE:
        return fail_api(e)
    from gpulab.hub.cli.common import error_text

    why = error_text(e) + (f" (HTTP {e.status})" if e.status else "")
    who = f" --user {args.user}" if getattr(args, "user", None) else ""
    again = f"gpulab jobs logs {name}{' ' + replica if replica else ''}{who} -f"
    print(f"gpulab: the hub stopped answering while following job '{name}': {why}\n"
          f"The job goes on without the hub. Follow it again once the hub is back: {again}  "
          f"(its state: gpulab jobs show {name}{who})", file=sys.stderr)
    return 1


def whose_job_hint(client, name: str) -> str:
    """For an admin whose own job `name` does not exist: whose it is, when it is someone
    else's (``ann has one: gpulab jobs show x --user ann``), else how to name another
    person's job; for everyone else nothing. A failing look-up costs only the hint."""
    try:
        if not client.me().get("admin"):
            return ""
        owners = sorted({j["user"] for j in client.jobs(everyone=True) if j.get("name") == name})
    except (GpulabError, KeyError, TypeError, AttributeError):
        owners = None
    if owners and len(owners) == 1:
        return f"{owners[0]} has one: add --user {owners[0]} (an admin may name whose job)."
    if owners:
        return (f"{', '.join(owners[:-1])} and {owners[-1]} have one: add --user NAME "
                "to say whose.")
    return ("To act on another person's job, add --user NAME (`gpulab jobs list --all` "
            "lists everyone's).")


def cmd_jobs(args) -> int:
    if args.action is None:
        print("gpulab jobs: choose submit, list, show, logs, stop or export (see gpulab jobs -h)",
              file=sys.stderr)
        return EXIT_USAGE
    if args.action == "export":
        try:
            sys.stdout.write(export_tfjob(args))
        except UsageError as e:
            print(f"gpulab jobs export: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        return 0
    spec = None
    if args.action == "submit":  # a bad spec is refused before the hub is asked anything
        try:
            spec = spec_from_args(args)
        except UsageError as e:
            print(f"gpulab jobs submit: error: {e}", file=sys.stderr)
            return EXIT_USAGE
    try:
        client = hub_client(args)
        if args.action == "submit":
            submitted = client.submit(spec)
            job = submitted.view
            if args.json:
                print(json.dumps(job, indent=2))
            else:
                print(f"submitted {job['name']}: {state_words(job)}: {job['reason']}")
            if args.follow:
                try:
                    follow_logs(submitted, lead_replica(job["strategy"]), True)
                    job = submitted.status()
                except GpulabError as e:
                    return hub_gone(e, args, job["name"])
                print(f"{job['name']}: {job['state']}: {job['reason']}")
                return 0 if job["state"] == "Succeeded" else 1
        elif args.action == "list":
            jobs = client.jobs(None if args.all else args.user, everyone=args.all)
            if args.json:
                print(json.dumps(jobs, indent=2))
            else:
                print(table([[j["name"], j["user"], kind_words(j), state_words(j), j["gpus"],
                              _elapsed(j), j["reason"]] for j in jobs],
                            ["NAME", "USER", "STRATEGY", "STATE", "GPUS", "ELAPSED", "REASON"]))
        elif args.action == "show":
            job = client.job(args.name, user=args.user).status()
            print(json.dumps(job, indent=2)) if args.json else print_job(job)
        elif args.action == "stop":
            job = client.job(args.name, user=args.user).stop()
            print(json.dumps(job, indent=2) if args.json else
                  f"{job['name']}: {job['state']}: {job['reason']}")
        elif args.action == "logs":
            job = client.job(args.name, user=args.user)
            replica = args.replica or lead_of_view(job.status())
            if not args.follow:
                return follow_logs(job, replica, False, args.raw)
            try:
                return follow_logs(job, replica, True, args.raw)
            except GpulabError as e:
                return hub_gone(e, args, args.name, replica if args.replica else None)
    except GpulabError as e:
        if (e.status == 404 and args.action in ("show", "stop", "logs") and not args.user
                and e.message == f"You have no job named '{args.name}'."):
            hint = whose_job_hint(client, args.name)
            e.message = f"{e.message} {hint}" if hint else e.message
        return fail_api(e)
    except KeyboardInterrupt:
        return 130
    return 0
