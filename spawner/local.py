"""`LocalGPUSpawner`: notebook servers as local processes bound to whole GPUs."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import html
import inspect
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jupyterhub.spawner import LocalProcessSpawner, set_user_setuid
from jupyterhub.traitlets import ByteSpecification
from traitlets import (Bool, Callable, Float, Int, List, TraitError, Unicode, Union, default,
                       validate)

from gpulab.hub.machine.accounts import (
    AccountConflict,
    AccountError,
    account_lock,
    ensure_account,
    prepare_user_folder,
    safe_name,
    safe_slug,
    server_slug,
    server_stem,
    system_username,
)
from gpulab.hub.machine import sandbox
from gpulab.hub.machine import egress
from gpulab.hub.machine.personnet import NetworkUnusable, PersonNetworks, loopback_address
from gpulab.hub.machine.userdisk import DiskError, PersonDisks
from gpulab.hub.machine.cgroups import (Group, default_pids, default_user_processes, limit_user_processes,
                      local_cgroups, memory_bytes, person_unit, set_oom_score_adj,
                      share_of_cpus, share_of_memory)
from gpulab.hub.quota import events
from gpulab.hub.quota.ledger import AdmissionRefused, Allocation, BadRequest, Ledger, Request
from gpulab.hub.quota.waiting import GPUQueue, Queue, QueueRefused, queue_of

from gpulab.hub.machine.processes import pid_alive

from .mixin import GPUSpawnerMixin, LineAhead, OptionRefused, SpawnRefused
from .profiles import (GPUProfile, OptionError, ProfileError, Selection, gpu_request,
                       merge_overrides)
from .queuewait import WAIT_KEY, allowed_waits, decide, parse_wait_minutes, progress_message

#: Spawner traits a profile's (or a profile option's) kubespawner_override sets locally
_PROFILE_TRAITS = ("cpu_limit", "cpu_guarantee", "mem_limit", "mem_guarantee", "default_url",
                   "environment", "cmd", "args")
#: the Jupyter runtime folder of servers with a private /tmp (kernels' sockets are made there)
SERVER_RUNTIME_DIR = "/tmp/jupyter-runtime"
#: override keys that choose the GPUs (their count and model), not a trait of this spawner
_GPU_KEYS = ("extra_resource_limits", "extra_resource_guarantees", "node_selector")


class LocalGPUSpawner(GPUSpawnerMixin, LocalProcessSpawner):
    """Starts each server as a local process on the GPUs of the profile the user chose.

    As root, each hub user's server runs as its own system account (``jupyter-<name>``,
    `gpulab.hub.machine.accounts`: an injective mapping, and an account made for another hub user
    is never handed out); otherwise every server runs as the hub's account and users are not
    isolated. As root, every server also runs in a control group of its own
    (`gpulab.hub.machine.cgroups`), named by the hub's user id and the server's name and recorded
    in the spawner's state: it enforces the profile's ``cpu_limit`` / ``mem_limit`` (also
    passed as ``CPU_LIMIT`` / ``MEM_LIMIT``) and `pids_limit`, lets the server open only its
    own GPUs' device nodes, and on stop everything in it is killed, whatever the server left
    running. Its processes start with ``RLIMIT_NPROC`` at `max_user_processes`. A profile
    that sets no ``mem_limit`` / ``cpu_limit`` gets `default_mem_limit` / `default_cpu_limit`;
    all servers and training replicas of one person together stay within `person_mem_limit`
    / `person_cpu_limit` (their groups nest in the person's), and the kernel's OOM killer
    picks servers (`oom_score_adj`) before the hub, its proxy and the gpulab service.

    A GPU server whose GPUs are busy may wait in the GPU queue (``user_options``
    ``gpu_wait_minutes``, `gpulab.spawner.queuewait`): its start then waits for its turn,
    the spawn-pending page says where it stands, and its ``start_timeout`` is raised by the
    wait chosen for that start.
    """

    #: seconds between two looks at the queue while a server waits in it
    gpu_queue_poll_seconds = 1.0
    #: the queue entry this server's start waits on ('' when it does not wait)
    gpu_queue_entry = ""
    _gpu_queue_admitted = False

    profile_list = Union(
        [List(), Callable()],
        default_value=[],
        help="""The GPU profiles offered in the spawn form, in KubeSpawner's ``profile_list``
        shape (``display_name``, ``slug``, ``description``, ``default``,
        ``kubespawner_override``, ``profile_options``), plus gpulab's ``allowed_groups``, so
        one list serves local and Kubernetes mode.

        The GPU count is ``extra_resource_limits["nvidia.com/gpu"]``, the GPU model
        ``node_selector["nvidia.com/gpu.product"]``, both after the overrides of the profile
        and of the chosen options. Locally an override sets ``environment`` (merged),
        ``cmd``, ``args``, ``default_url``, ``cpu_limit``, ``mem_limit`` (and their
        guarantees); other KubeSpawner keys (``image``, volumes…) are ignored in a profile's
        own override and refused in an option's (the person chose something a local server
        cannot do). ``allowed_groups``: only members of these groups see and may start the
        profile. Empty (default): "CPU only" plus 1, 2, 4 and 8 GPUs as far as the machine
        has them. A callable takes the spawner and returns the list. Example::

            c.LocalGPUSpawner.profile_list = [
                {"display_name": "CPU only", "slug": "cpu"},
                {"display_name": "1 GPU", "slug": "gpu-1", "default": True,
                 "kubespawner_override": {"extra_resource_limits": {"nvidia.com/gpu": "1"}},
                 "profile_options": {"interface": {"display_name": "Interface", "choices": {
                     "lab": {"display_name": "JupyterLab",
                             "kubespawner_override": {"default_url": "/lab"}},
                     "classic": {"display_name": "Notebook",
                                 "kubespawner_override": {"default_url": "/tree"}}}}}},
                {"display_name": "4 GPUs", "slug": "gpu-4", "allowed_groups": ["ml-team"],
                 "kubespawner_override": {"extra_resource_limits": {"nvidia.com/gpu": "4"}}},
            ]
        """,
    ).tag(config=True)

    shared_dir = Unicode(
        help="""The shared storage folder: ``datasets/`` (read-only for users) and
        ``users/<name>/`` (each user's own folder, the server's root directory).

        Default: ``$GPULAB_SHARED_DIR``. ``gpulab up`` sets it from ``--shared-dir``.
        Example: ``c.LocalGPUSpawner.shared_dir = "/srv/gpulab/shared"``
        """,
    ).tag(config=True)

    @default("shared_dir")
    def _shared_dir_default(self):
        return os.environ.get("GPULAB_SHARED_DIR", "")

    service_url = Unicode(
        "",
        help="""Where notebook servers reach the gpulab service (quotas, training jobs), given
        to them as ``GPULAB_SERVICE_URL`` for the notebook client and widgets.

        ``gpulab up`` sets it to the service's own loopback address
        (``http://127.0.0.1:<service-port>/services/gpulab/``); '' (default) leaves the client
        to find it through the hub's public address.
        """,
    ).tag(config=True)

    isolate_users = Bool(
        help="""Run each user's server as its own system account (``jupyter-<name>``,
        created on first spawn) and give that account sole access to the user's folder.

        Default: True when the hub runs as root, which this requires; False otherwise, when
        all servers run as the hub's own account. Example: ``c.LocalGPUSpawner.isolate_users = True``
        """,
    ).tag(config=True)

    @default("isolate_users")
    def _isolate_default(self):
        return os.geteuid() == 0

    system_user_prefix = Unicode(
        "jupyter-",
        help="""Prefix of the system account made for each hub user when users are isolated
        (default ``jupyter-``, as in The Littlest JupyterHub). Long or unusual names are
        shortened with a hash. Example: ``c.LocalGPUSpawner.system_user_prefix = "lab-"``
        """,
    ).tag(config=True)

    home_dir_template = Unicode(
        "",
        help="""Home folder of servers when users are not isolated; ``{username}`` is the hub
        user name. Default '' keeps the hub account's home. ``gpulab up`` sets it to
        ``<data-dir>/homes/{username}``. Isolated servers use their account's home.
        """,
    ).tag(config=True)

    server_log_dir = Unicode(
        "",
        help="""Folder for one log file per server (``<user>.<server>.log``); '' (default)
        leaves servers' output on the hub's own output. ``gpulab up`` sets it to
        ``<data-dir>/logs/servers``.
        """,
    ).tag(config=True)

    server_certs_dir = Unicode(
        "",
        help="""With ``c.JupyterHub.internal_ssl``: the folder holding each server's TLS key
        and certificates, one root-owned folder per server that only the server's account
        (group) may read. It must lie outside the hub's certificate store, which only the
        hub's account may enter. Default '': ``server-certs`` beside
        ``internal_certs_location``. ``gpulab up`` sets ``<data-dir>/server-certs``.
        Example: ``c.LocalGPUSpawner.server_certs_dir = "/srv/gpulab/server-certs"``
        """,
    ).tag(config=True)

    ip_per_server = Bool(
        False,
        help="""Give every server a loopback address of its own, derived from its hub
        id (``Spawner.orm_spawner.id``, unique among the hub's servers and kept across hub
        restarts) in 127.1.0.1 - 127.255.255.254 (never a ``.0`` or ``.255`` host part, never
        127.0.0.x, where the hub, the proxy's API and the gpulab service listen), instead of
        `ip`. With ``c.JupyterHub.internal_ssl`` each server's certificate (which its
        account can read) then names only that address (see
        `gpulab.hub.deploy.local.server_alt_names`), so no user's certificate is valid for another
        user's server: whoever binds a port on another server's address after it died gets
        no request from the proxy. Linux routes all of 127.0.0.0/8 to ``lo``.

        Default False (JupyterHub's `ip`); ``gpulab up`` sets True. To have every server
        listen on one address instead: ``c.LocalGPUSpawner.ip_per_server = False`` and
        ``c.LocalGPUSpawner.ip = "127.0.0.2"``.
        """,
    ).tag(config=True)

    enforce_limits = Bool(
        True,
        help="""Enforce a profile's ``cpu_limit`` and ``mem_limit`` (or the defaults,
        `default_mem_limit` / `default_cpu_limit`) in the server's control group (cgroup v2
        or v1; needs root). False: the group (which every server gets where control groups
        can be made, for its GPU device allow-list and a clean stop) has no CPU or memory
        limit of its own; its person's (`person_mem_limit`) still holds. Where groups cannot
        be made the limits are only passed to the server as ``CPU_LIMIT`` / ``MEM_LIMIT``
        and the hub log says why (default True).
        Example: ``c.LocalGPUSpawner.enforce_limits = False``
        """,
    ).tag(config=True)

    # -- the process bound (issue 36) --------------------------------------------------
    pids_limit = Int(
        help="""Most processes and threads one notebook server may hold together: the
        server, its kernels, terminals and whatever they start (its control group's ``pids``
        controller, v1 or v2, as root; a fork or a new thread beyond it fails with EAGAIN, so
        a fork bomb stops there instead of taking every process number of the machine, the
        hub's included). Default 1024, or 8 per CPU on machines with more than 128 CPUs: a
        TensorFlow kernel starts about two threads per CPU (9 on a 2-CPU machine) and a
        Jupyter server about 10, so a server's usual kernels fit many times over. Not
        switched off by `enforce_limits`. 0: no bound.
        Example: ``c.LocalGPUSpawner.pids_limit = 4096``
        """,
    ).tag(config=True)

    @default("pids_limit")
    def _pids_limit_default(self):
        return default_pids(1024, 8)

    max_user_processes = Int(
        help="""``RLIMIT_NPROC`` of every server's processes (as root, set before the server
        becomes its person's account): the most processes and threads of that account
        together, in all its servers and training replicas, the second line against a fork
        bomb where control groups cannot be made (the kernel's own default here, 96,367, is
        above ``pid_max``). Default: a quarter of what the kernel can hold (the smaller of
        ``pid_max`` and ``threads-max``; 8,192 where ``pid_max`` is 32,768), at least 1,024;
        training replicas follow it unless ``c.GPUJobs.max_user_processes`` is set. 0: left
        as it is.
        Example: ``c.LocalGPUSpawner.max_user_processes = 4096``
        """,
    ).tag(config=True)

    @default("max_user_processes")
    def _max_user_processes_default(self):
        return default_user_processes()

    # -- memory and CPU by default, and for each person as a whole (issue 36) ----------
    default_mem_limit = ByteSpecification(
        help="""The memory limit of a server whose profile sets no ``mem_limit`` (the
        default of ``mem_limit``; a profile's ``kubespawner_override`` and an operator's
        ``c.Spawner.mem_limit`` still win). Enforced by the server's control group as root
        (`enforce_limits`): a program over it is killed by the kernel, the rest of the
        machine untouched. Default: a quarter of this machine's memory (``MemTotal``, whole
        MiB; 6 GiB on a 24 GiB machine), so that one notebook can hold a real data set while
        no single one takes the memory of everyone else's; 0: no default limit. Suffixes K,
        M, G, T. Example: ``c.LocalGPUSpawner.default_mem_limit = "8G"``
        """,
    ).tag(config=True)

    @default("default_mem_limit")
    def _default_mem_limit_default(self):
        return share_of_memory(0.25)

    default_cpu_limit = Float(
        help="""The CPU limit of a server whose profile sets no ``cpu_limit`` (the default of
        ``cpu_limit``; a profile's override and ``c.Spawner.cpu_limit`` still win), in CPUs
        (0.5: half of one). Enforced by the server's control group as root: beyond it the
        server is throttled. Default: half of this machine's CPUs, at least 1, so that one
        busy notebook leaves the other half to everyone else; 0: no default limit.
        Example: ``c.LocalGPUSpawner.default_cpu_limit = 4``
        """,
    ).tag(config=True)

    @default("default_cpu_limit")
    def _default_cpu_limit_default(self):
        return share_of_cpus(0.5)

    @default("mem_limit")
    def _mem_limit_default(self):
        return self.default_mem_limit or None

    @default("cpu_limit")
    def _cpu_limit_default(self):
        return self.default_cpu_limit or None

    person_mem_limit = ByteSpecification(
        help="""The memory all servers and training replicas of one person may use
        together, whatever each one's own limit (as root: their control groups nest in one
        group of that person, ``gpulab/person-<hub>-<name>/``, which has this limit; it is
        made with their first server or replica and removed with their last). Many servers
        and replicas of one person, each within its own limit (replicas get
        ``c.GPUJobs.default_memory`` each, 32 of them per person), cannot then take the
        machine from everyone else. Default: half of this machine's memory (12 GiB on a 24
        GiB machine), leaving the other half to other people and to the hub; 0: no limit.
        The gpulab service applies the same value to replicas (the hub hands it over).
        Suffixes K, M, G, T. Example: ``c.LocalGPUSpawner.person_mem_limit = "16G"``
        """,
    ).tag(config=True)

    @default("person_mem_limit")
    def _person_mem_limit_default(self):
        return share_of_memory(0.5)

    person_cpu_limit = Float(
        help="""The CPUs all servers and training replicas of one person may use together
        (their person-level control group, as for `person_mem_limit`; a server's or replica's
        own CPU limit is at most this). Default: three quarters of this machine's CPUs, at
        least 1, so that one person's busy work leaves a quarter to everyone else and to the
        hub; 0: no limit. Example: ``c.LocalGPUSpawner.person_cpu_limit = 8``
        """,
    ).tag(config=True)

    @default("person_cpu_limit")
    def _person_cpu_limit_default(self):
        return share_of_cpus(0.75)

    oom_score_adj = Int(
        500,
        help="""``oom_score_adj`` of every server and training replica (-1000..1000; set as
        root before the process becomes its person's account, who cannot lower it then).
        When the machine runs out of memory the kernel kills the process with the highest
        score: people's work, 500 by default, goes before the hub, its proxy and the gpulab
        service (``c.GpulabHub.oom_score_adj``, -900). Example:
        ``c.LocalGPUSpawner.oom_score_adj = 300``
        """,
    ).tag(config=True)

    private_tmp = Bool(
        help="""Give every server a private ``/tmp`` (a mount namespace of its own, as
        systemd's ``PrivateTmp``): a folder of the server's account under `private_tmp_dir`,
        mounted on ``/tmp`` for the server and everything it starts, and removed when the
        server stops. Fixed paths such as ``/tmp/my_working_dir`` then neither collide with
        nor leak to other people. Default: True when the hub runs as root, which this needs.
        Example: ``c.LocalGPUSpawner.private_tmp = False``
        """,
    ).tag(config=True)

    @default("private_tmp")
    def _private_tmp_default(self):
        return os.geteuid() == 0

    private_tmp_dir = Unicode(
        "/var/lib/gpulab/server-tmp",
        help="""Where the servers' private ``/tmp`` folders are kept (a root-owned 0700 folder
        with one 0700 folder per running server, owned by its account; default
        ``/var/lib/gpulab/server-tmp``). Example:
        ``c.LocalGPUSpawner.private_tmp_dir = "/srv/gpulab/tmp"``
        """,
    ).tag(config=True)

    private_ipc = Bool(
        help="""Give every server private IPC, as systemd's ``PrivateIPC``: an IPC namespace of
        its own (System V shared memory, semaphores, message queues; POSIX message queues) and
        a fresh ``/dev/shm`` (POSIX shared memory) of `shm_size`, so nobody else sees, reads or
        squats a name the person's programs use there. Default: True when the hub runs as
        root, which this needs. Example: ``c.LocalGPUSpawner.private_ipc = False``
        """,
    ).tag(config=True)

    @default("private_ipc")
    def _private_ipc_default(self):
        return os.geteuid() == 0

    shm_size = Unicode(
        "",
        help="""Size of a server's private ``/dev/shm`` (with `private_ipc`): a size such as
        ``16Gi`` or ``512Mi``. Default '': the server's memory limit (its profile's
        ``mem_limit``), or where it has none the kernel's default for tmpfs, half the RAM.
        What a server keeps there counts against its memory limit whatever this size (its
        pages are charged to the server's control group), so the limit is the sensible bound;
        a small fixed size, such as Docker's 64 MB, makes TensorFlow's and PyTorch's data
        loaders (``DataLoader(num_workers=...)``) fail with "No space left on device" or a bus
        error. Example: ``c.LocalGPUSpawner.shm_size = "8Gi"``
        """,
    ).tag(config=True)

    @validate("shm_size")
    def _valid_shm_size(self, proposal):
        try:
            memory_bytes(proposal["value"])
        except ValueError as e:
            raise TraitError(f"LocalGPUSpawner.shm_size: {e}") from e
        return proposal["value"]

    hide_processes = Bool(
        help="""Give every server a ``/proc`` that shows only its own account's processes (a
        procfs instance of its own mounted with ``hidepid=invisible``, as systemd's
        ``ProtectProc=invisible``): other people's processes, command lines and environments
        are neither listed nor readable from a server. Default: True when the hub runs as
        root, which this needs. Example: ``c.LocalGPUSpawner.hide_processes = False``
        """,
    ).tag(config=True)

    @default("hide_processes")
    def _hide_processes_default(self):
        return os.geteuid() == 0

    kernels_over_unix_sockets = Bool(
        help="""Start the server's kernels with ZeroMQ's ``ipc`` transport (Unix sockets,
        ``--KernelManager.transport=ipc`` on the server's command line, which no config file
        of the person's overrides) instead of TCP ports on 127.0.0.1. A kernel's IOPub
        channel is a publish socket: anyone on the machine who connects to its port reads
        every cell it runs and all their output (message signing stops forgery, not reading).
        Its sockets are made in the Jupyter runtime folder, which with `private_tmp` is
        ``/tmp/jupyter-runtime`` inside the server's private ``/tmp`` (``JUPYTER_RUNTIME_DIR``;
        mode 0700), so only the server's own processes can reach them; without `private_tmp`
        it is the account's own ``~/.local/share/jupyter/runtime`` (0700), where a long home
        path may make a socket's path longer than Linux's 107 bytes and kernels fail to
        start. Kernels a person starts by hand (``jupyter console``) follow their own
        settings. Default: True when users are isolated (`isolate_users`). Example:
        ``c.LocalGPUSpawner.kernels_over_unix_sockets = False``
        """,
    ).tag(config=True)

    @default("kernels_over_unix_sockets")
    def _kernels_ipc_default(self):
        return self.isolate_users

    private_network = Bool(
        help="""Run all servers of one person in a network namespace of that person's own
        (`gpulab.hub.machine.personnet`): it holds only loopback, so what a notebook serves on
        any port (a ``tf.distribute.Server`` listens on every address) is reached by that
        person's other kernels and servers on ``127.0.0.1`` and by nobody else. The proxy
        and the hub reach each server through a relay on the server's own address and port;
        the server reaches the hub's API and the gpulab service (their loopback addresses and
        ports, relayed into the namespace) and no other port of the machine; the network
        beyond it only through the hub's egress proxy inside the namespace
        (`notebook_egress`). The namespace is made
        with the person's first server and removed with their last. Needs the hub's API and
        `service_url` on loopback addresses. Default: True when users are isolated
        (`isolate_users`, as root). Example: ``c.LocalGPUSpawner.private_network = False``
        """,
    ).tag(config=True)

    @default("private_network")
    def _private_network_default(self):
        return self.isolate_users and os.geteuid() == 0

    notebook_egress = Bool(
        True,
        help="""With `private_network`: notebooks reach the network (``pip install``, data set
        downloads, ``git clone``, ``wget``) through an HTTP proxy the hub runs inside each
        person's namespace on ``127.0.0.1:3128`` (`gpulab.hub.machine.egress`; the server's
        ``HTTP_PROXY``/``HTTPS_PROXY``/``http_proxy``/``https_proxy`` name it, ``NO_PROXY``
        keeps loopback direct). It tunnels ``CONNECT`` (HTTPS) and forwards plain ``http://``
        requests, resolves each name itself and refuses (403) every address of this machine
        (loopback and its interfaces' addresses: other people's servers, the hub's ports) and
        of the networks its interfaces are on (containers on a bridge, the LAN), link-local
        addresses (the cloud's metadata service), ``100.64.0.0/10``,
        ``168.63.129.16``, ``100.100.100.200``, multicast and reserved addresses, and
        `egress_refused_networks`. Programs that ignore the proxy variables (raw sockets) reach
        nothing. False: no network beyond the hub at all (put packages and data sets where
        servers read them). Example: ``c.LocalGPUSpawner.notebook_egress = False``
        """,
    ).tag(config=True)

    egress_refused_networks = List(
        Unicode(),
        help="""Networks (CIDRs) the egress proxy (`notebook_egress`) refuses besides the
        built-in ones, e.g. private networks routed beyond the machine's own, where other
        machines' services or credentials are. Example: ``c.LocalGPUSpawner.egress_refused_networks = ["10.0.0.0/8",
        "192.168.0.0/16"]``
        """,
    ).tag(config=True)

    @validate("egress_refused_networks")
    def _valid_refused_networks(self, proposal):
        try:
            egress.parse_networks(proposal["value"])
        except ValueError as e:
            raise TraitError(str(e)) from e
        return proposal["value"]

    @default("cmd")
    def _cmd_default(self):
        # The hub's own interpreter: the same installation serves every account.
        return [sys.executable, "-m", "jupyterhub.singleuser"]

    @default("apply_user_options")
    def _apply_user_options_default(self):
        # user_options are validated and applied in start(), as KubeSpawner does
        return self._gpu_apply_user_options

    @default("options_form")
    def _options_form_default(self):
        return self._gpu_form

    @default("options_from_form")
    def _options_from_form_default(self):
        return self._gpu_options_from_form

    async def _gpu_form(self, spawner) -> str:
        """The GPU profiles with what each would get now (rendered at every visit; the
        ledger is read in a worker thread, JupyterHub awaits an async ``options_form``)."""
        return await self.render_gpu_form()

    @default("notebook_dir")
    def _notebook_dir_default(self):
        return str(self.user_folder) if self.shared_dir else ""

    # -- waiting in the GPU queue --------------------------------------------------------

    def gpu_queue_settings(self) -> GPUQueue:
        return GPUQueue(config=self.config)

    def gpu_longest_wait(self) -> int:
        """The longest wait a person may choose, in minutes (0: the queue is off)."""
        settings = self.gpu_queue_settings()
        return settings.longest_notebook_wait_minutes if settings.enabled else 0

    def gpu_extra_option_keys(self) -> tuple[str, ...]:
        return (WAIT_KEY,)

    def gpu_wait_choices(self) -> tuple[int, ...]:
        return allowed_waits(self.gpu_longest_wait())

    def gpu_selection(self, user_options: dict | None = None) -> Selection:
        selection = super().gpu_selection(user_options)
        self.gpu_wait_minutes(user_options)  # a bad value is refused with the rest (400)
        return selection

    def gpu_wait_minutes(self, user_options: dict | None = None) -> int:
        """The longest wait in the queue chosen for this start (0: don't wait); 400 when the
        value is not one this hub offers."""
        options = self.user_options if user_options is None else user_options
        try:
            return parse_wait_minutes(options if isinstance(options, dict) else {},
                                      self.gpu_longest_wait())
        except OptionError as e:
            raise OptionRefused(400, str(e)) from e

    @validate("user_options")
    def _gpu_wait_not_in_start_timeout(self, proposal):
        """JupyterHub sets ``user_options`` just before it starts the server, and reads
        ``start_timeout`` right after calling `start` (`jupyterhub.user.User.spawn`): the wait
        chosen is added to the operator's ``start_timeout`` for that start (put back when the
        start ends). Checked at every set, also of the same options (an observer would miss
        those)."""
        base = self.__dict__.get("_gpu_base_start_timeout")
        if base is None or self.start_timeout != self.__dict__.get("_gpu_raised_to"):
            base = self.start_timeout  # the operator's, or changed since by their hook
        try:
            minutes = parse_wait_minutes(proposal["value"] if isinstance(proposal["value"], dict)
                                         else {}, self.gpu_longest_wait())
        except OptionError:
            minutes = 0  # refused by start, before anything waits
        self._gpu_base_start_timeout = base
        self._gpu_raised_to = base + minutes * 60
        self.start_timeout = self._gpu_raised_to
        return proposal["value"]

    def _gpu_restore_start_timeout(self) -> None:
        base = self.__dict__.pop("_gpu_base_start_timeout", None)
        raised = self.__dict__.pop("_gpu_raised_to", None)
        if base is not None and self.start_timeout == raised:
            self.start_timeout = base

    def gpu_line(self, ledger: Ledger) -> Queue | None:
        """The queue (when it is on): a start never takes free GPUs ahead of whoever waits.
        One that may wait queues behind them; one that does not is refused, as a job with
        ``wait: false`` is (free GPUs may be what the head of the line is waiting for)."""
        return queue_of(ledger, self.gpu_queue_settings())

    async def gpu_when_refused(self, ledger: Ledger, request: Request, profile: GPUProfile,
                               refused: AdmissionRefused) -> Allocation:
        """Wait in the queue for what the ledger refused now, when the person chose to wait
        and it could run later (what never could, `QueueRefused`, is refused at once)."""
        minutes = self.gpu_wait_minutes()
        settings = self.gpu_queue_settings()
        queue = queue_of(ledger, settings) if minutes else None
        if queue is None:
            if isinstance(refused, LineAhead) and self.gpu_longest_wait():
                refused = LineAhead(refused.message + " Choose a wait under \"If the GPUs are "
                                    "busy\" to take your place in line.")
            return await super().gpu_when_refused(ledger, request, profile, refused)
        wait_until = time.time() + minutes * 60

        def enqueue():
            # JupyterHub starts a server only when it holds it stopped: an entry of an earlier
            # start of this server is left over
            queue.forget(request.user, "notebook", request.holder, "a new start of the server")
            return queue.enqueue(request, wait_until=wait_until)

        # the entry commits in its thread whatever happens here: a start cancelled meanwhile
        # takes it out of line again
        queued = asyncio.ensure_future(asyncio.to_thread(enqueue))
        try:
            entry = await asyncio.shield(queued)
        except asyncio.CancelledError:
            queued.add_done_callback(lambda f: f.cancelled() or f.exception() or (
                asyncio.ensure_future(asyncio.to_thread(
                    _leave_queue, queue, ledger, request, f.result().id,
                    "the start was cancelled"))))
            raise
        except QueueRefused as e:  # it could never run: refused at once, as without a queue
            if isinstance(refused, LineAhead):  # the ledger was not asked: the queue's reason
                refused = AdmissionRefused(e.message)
            return await super().gpu_when_refused(ledger, request, profile, refused)
        except BadRequest as e:
            raise SpawnRefused(409, f"Cannot start with profile '{profile.display_name}'. "
                               + e.message) from e
        events.admitted("notebook", "queued")
        self.log.info("%s waits in the GPU queue (entry %s, up to %d min): %s",
                      self._log_name, entry.id, minutes, refused.message)
        self.gpu_queue_entry = entry.id
        try:
            return await self._gpu_wait(queue, ledger, entry.id)
        except asyncio.CancelledError:
            # start_timeout, the hub stopping, the person's stop: out of line, and GPUs that
            # arrived meanwhile go back (in a thread that outlives this cancelled start)
            asyncio.ensure_future(asyncio.to_thread(
                _leave_queue, queue, ledger, request, entry.id, "the start was cancelled"))
            raise
        except BaseException:
            await asyncio.to_thread(_leave_queue, queue, ledger, request, entry.id,
                                    "the server did not start")
            raise
        finally:
            self.gpu_queue_entry = ""

    async def _gpu_wait(self, queue: Queue, ledger: Ledger, entry_id: str) -> Allocation:
        """Run a scheduling pass about every second (the gpulab service runs them for jobs;
        the hub runs them while a notebook waits) until the entry is admitted (its
        allocation is returned) or leaves the line (`SpawnRefused` 409 with the reason)."""
        while True:
            await asyncio.to_thread(queue.schedule)
            entry = await asyncio.to_thread(queue.get, entry_id)
            what, message = decide(entry)
            if what == "admitted":
                allocation = await asyncio.to_thread(ledger.get, entry.allocation_id)
                if allocation is None or not allocation.open:
                    raise SpawnRefused(409, "The GPUs given to your server from the queue "
                                       "were taken back before it started; start it again.")
                self._gpu_queue_admitted = True
                self.log.info("%s leaves the GPU queue with GPUs %s", self._log_name,
                              list(allocation.devices))
                return allocation
            if what == "refused":
                raise SpawnRefused(409, message)
            await asyncio.sleep(self.gpu_queue_poll_seconds)

    async def progress(self):
        """JupyterHub's events, then, while this start waits in the GPU queue, where it
        stands (read from the queue about every second; a new event when it changes)."""
        async for event in super().progress():
            yield event
        last = None
        while True:
            entry_id = self.gpu_queue_entry
            if entry_id:
                message = await self._gpu_progress_message(entry_id)
                if message and message != last:
                    last = message
                    yield {"progress": 50, "message": message,
                           "html_message": (
                               f"{html.escape(message)} · <a class=\"gpulab-leave-queue\" "
                               f"href=\"{html.escape(self.gpu_service_url())}#queue\">Leave "
                               "the queue</a>"),
                           "gpulab_queue": {"entry": entry_id}}
            elif last is not None and self._gpu_queue_admitted:
                last = None
                yield {"progress": 70, "message": "GPUs are free: starting your server."}
            await asyncio.sleep(self.gpu_queue_poll_seconds)

    def gpu_service_url(self) -> str:
        """The gpulab service's pages as the browser reaches them (My GPUs, where a person
        leaves the queue: its API takes the service's own cookie and XSRF token, which a hub
        page cannot send)."""
        hub = (getattr(self.hub, "base_url", "") or "/hub/") if self.hub else "/hub/"
        base = hub[:-len("hub/")] if hub.endswith("hub/") else "/"
        settings = getattr(getattr(self, "user", None), "settings", None) or {}
        if settings.get("subdomain_host"):
            # the service on a host of its own (JupyterHub's <name>--service.<host>)
            from urllib.parse import urlsplit

            from jupyterhub.utils import subdomain_hook_idna

            url = urlsplit(settings["subdomain_host"])
            hook = settings.get("subdomain_hook") or subdomain_hook_idna
            host = hook("gpulab", settings.get("domain") or url.hostname, "service")
            base = f"{url.scheme}://{host}{f':{url.port}' if url.port else ''}{base}"
        return base + "services/gpulab/"

    async def _gpu_progress_message(self, entry_id: str) -> str:
        ledger, settings, user = self.gpu_ledger, self.gpu_queue_settings(), self.user.name
        queue = queue_of(ledger, settings)
        if queue is None:
            return ""
        entries = await asyncio.to_thread(queue.entries, user)
        entry = next((e for e in entries if e.id == entry_id), None)
        return progress_message(entry) if entry is not None else ""

    # -- where things are -------------------------------------------------------------

    @property
    def system_user(self) -> str:
        if self.isolate_users:
            return system_username(self.system_user_prefix, self.user.name)
        return pwd.getpwuid(os.geteuid()).pw_name

    @property
    def user_folder(self) -> Path:
        return Path(self.shared_dir) / "users" / safe_name(self.user.name)

    @property
    def home_dir(self) -> str:
        if self.isolate_users:
            return pwd.getpwnam(self.system_user).pw_dir
        if self.home_dir_template:
            return self.home_dir_template.format(username=safe_name(self.user.name))
        return os.path.expanduser("~")

    # -- LocalProcessSpawner hooks ------------------------------------------------------

    def make_preexec_fn(self, name):
        group = self._server_group
        nproc = self.max_user_processes if self.isolate_users else 0
        oom = self.oom_score_adj
        tmp, keep = self._tmp_folder, self._tmp_keep()
        ipc, hide = self.private_ipc, self.hide_processes
        shm = self.shm_bytes()
        netns = self._netns_fd
        if self.isolate_users:
            then = set_user_setuid(self.system_user)
        else:
            home = self.home_dir

            def then():
                os.chdir(home)

        def preexec():
            if group is not None:
                group.join()  # as root still, before the server becomes its user
            limit_user_processes(nproc)  # RLIMIT_NPROC, as root still (issue 36)
            set_oom_score_adj(oom)  # as root still: the person cannot lower it (issue 36)
            if netns is not None:  # as root: the person's own network (issue 33)
                sandbox.join_netns(netns)
            if tmp is not None or ipc or hide:  # as root: a mount namespace of its own
                sandbox.private_tmp(tmp, keep=keep, ipc=ipc, shm_size=shm, hide_pids=hide)
            os.umask(0o022)  # a login's umask, not the hub's private 077
            then()

        return preexec

    def shm_bytes(self) -> int | None:
        """Bytes of the server's private /dev/shm: `shm_size`, else its memory limit, else
        None (the kernel's default for tmpfs: half the RAM)."""
        return memory_bytes(self.shm_size) or memory_bytes(self.mem_limit or None)

    # -- the server's control group: limits, GPU devices, a clean stop -------------------

    _server_group: Group | None = None
    #: the unit of the group this server runs in, kept in the spawner's state so that stop
    #: (also after a hub restart) removes exactly that group and no other
    _cgroup_unit: str | None = None

    @property
    def cgroup_unit(self) -> str:
        """``server-<hub>-u<hub user id>-<server>``: the hub's user id is unique and never
        reused for another name, `server_slug` is injective, and ``<hub>`` (a hash of the
        hub's database) tells apart hubs that share the machine, so no two servers share a
        group (nor a private /tmp folder, named the same)."""
        return f"server-{self._hub_tag()}-u{self.user.id}-{server_slug(self.name)}"

    @property
    def person_unit(self) -> str:
        """The person-level group every server and replica of this user nests in
        (`gpulab.hub.machine.cgroups.person_unit`: ``person-<hub>-<name>``)."""
        return person_unit(self._hub_tag(), self.user.name)

    def _hub_tag(self) -> str:
        db_url = str(self.config.JupyterHub.get("db_url", "sqlite:///jupyterhub.sqlite"))
        if db_url.startswith("sqlite:///") and not db_url.startswith("sqlite:////"):
            db_url = "sqlite:///" + os.path.abspath(db_url[len("sqlite:///"):])
        return hashlib.sha256(db_url.encode()).hexdigest()[:8]

    # -- the server's private /tmp ----------------------------------------------------------

    _tmp_folder: Path | None = None

    def _make_tmp_folder(self) -> Path | None:
        if not self.private_tmp:
            return None
        owner = None
        if self.isolate_users:
            entry = pwd.getpwnam(self.system_user)
            owner = (entry.pw_uid, entry.pw_gid)
        return sandbox.make_private_dir(self.private_tmp_dir, self.cgroup_unit, owner)

    def _tmp_keep(self) -> list[str]:
        """Folders the server needs that may lie below /tmp (a data folder made with mktemp,
        as in the tests): bound back in place inside its private /tmp."""
        keep = [self.shared_dir, self.notebook_dir]
        if not self.isolate_users:
            keep.append(self.home_dir)
            # the files `shell_cmd` names (``bash --rcfile /tmp/x/rc``): the server is the
            # hub's own account, which may read them anyway. (An isolated server is a
            # person's account: the hub's /tmp is not theirs to see; files its shell_cmd
            # reads lie elsewhere, readable by them.)
            keep += [os.path.dirname(a) for a in self.shell_cmd
                     if a.startswith("/tmp/") and os.path.isfile(a)]
        certs = (getattr(self, "cert_paths", None) or {}).get("keyfile")
        if self.internal_ssl and certs:
            keep.append(os.path.dirname(certs))
        keep = [os.path.abspath(k) for k in keep if k and os.path.isdir(k)]
        # a folder inside another kept one comes with it
        return [k for k in dict.fromkeys(keep)
                if not any(k != o and k.startswith(o.rstrip("/") + "/") for o in keep)]

    def _remove_tmp_folder(self, unit: str | None) -> None:
        self._tmp_folder = None
        if unit and self.private_tmp:
            sandbox.remove_private_dir(self.private_tmp_dir, unit)

    def _make_server_group(self, gpus: list[int]) -> Group | None:
        """The server's own control group: its profile's limits, only `gpus`' device nodes.
        None where control groups cannot be made here (logged)."""
        cgroups, why = local_cgroups()
        if cgroups is None:
            # (gpulab's own defaults are not worth a warning at every start: local_cgroups
            # said once why nothing is enforced)
            chosen = (self.mem_limit, self.cpu_limit) != (self.default_mem_limit or None,
                                                          self.default_cpu_limit or None)
            if (self.mem_limit or self.cpu_limit) and chosen:
                self.log.warning("Limits of %s (cpu %s, memory %s) not enforced: %s",
                                 self._log_name, self.cpu_limit, self.mem_limit, why)
            return None
        unit = self.cgroup_unit
        # a group of this very server left by a hub that died: its leftovers end now
        cgroups.find(unit).remove(kill=True)
        self._remove_tmp_folder(unit)
        limits = self.enforce_limits
        group = cgroups.make(unit, memory=(self.mem_limit or None) if limits else None,
                             cpus=(self.cpu_limit or None) if limits else None, gpus=gpus,
                             pids=self.pids_limit or None, person=self.person_unit,
                             person_memory=self.person_mem_limit or None,
                             person_cpus=self.person_cpu_limit or None)
        self._cgroup_unit = unit
        return group

    def _remove_server_group(self) -> None:
        """Kill everything in the server's own group and remove it (after a hub restart
        too: the unit comes from the spawner's state)."""
        self._server_group = None
        unit, self._cgroup_unit = self._cgroup_unit, None
        if unit is None:
            return
        cgroups, _ = local_cgroups()
        if cgroups is not None and not cgroups.find(unit).remove(kill=True):
            self.log.error("Processes of %s survived its stop in control group %s",
                           self._log_name, unit)
        self._remove_tmp_folder(unit)

    async def stop(self, now=False):
        try:
            await super().stop(now=now)
        finally:
            await asyncio.to_thread(self._remove_server_group)
            await self._leave_person_network()
        # its processes are gone: its GPUs go back (off the event loop; clear_state, which
        # JupyterHub calls next, then has nothing left to release)
        await self.release_gpus_async()
        await self._gpu_forget_queue_entry("server stopped")

    async def _gpu_forget_queue_entry(self, reason: str) -> None:
        """A server that came through the queue stopped: its entry (admitted, for an
        allocation now closed) leaves the queue too."""
        if not self._gpu_queue_admitted:
            return
        self._gpu_queue_admitted = False
        queue = queue_of(self.gpu_ledger, self.gpu_queue_settings())
        if queue is not None:
            await asyncio.to_thread(queue.forget, self.user.name, "notebook",
                                    self.gpu_holder_name, reason)

    async def poll(self):
        had_process = bool(self.pid)
        status = await super().poll()
        if status is not None and had_process and self._cgroup_unit:
            # the server ended by itself: JupyterHub will not call stop, but what it left
            # running (a daemon holding its GPUs) must end before the GPUs are handed out again
            await asyncio.to_thread(self._remove_server_group)
        if status is not None and had_process:
            await self._leave_person_network()
        elif status is None and self._netns_name:
            await self._adopt_person_network()
        return status

    def get_state(self):
        state = super().get_state()
        if self._cgroup_unit:
            state["gpulab_cgroup"] = self._cgroup_unit
        if self._netns_name:
            state["gpulab_netns"] = self._netns_name
        return state

    def load_state(self, state):
        super().load_state(state)
        unit = state.get("gpulab_cgroup") if state else None
        if unit:
            self._cgroup_unit = unit
        netns = state.get("gpulab_netns") if state else None
        if netns:
            self._netns_name = netns
        # JupyterHub calls this right after making the spawner (at hub start too), long
        # before create_certs reads the address for the certificate
        self._assign_server_ip()

    def _assign_server_ip(self) -> None:
        """With `ip_per_server`: `ip` becomes this server's own address (`server_ip`)."""
        if self.ip_per_server and self.orm_spawner is not None and self.orm_spawner.id:
            self.ip = server_ip(self.orm_spawner.id)

    # -- the person's network namespace (issue 33 item 2) --------------------------------

    #: the person's namespace this server runs in (kept in the spawner's state)
    _netns_name: str | None = None
    #: an fd of it while the server's process is being started (joined in preexec)
    _netns_fd: int | None = None

    def person_network_reach(self) -> list[tuple[str, int]]:
        """The addresses the server reaches from inside its person's namespace: the hub's API
        (as the server is told it, ``JUPYTERHUB_API_URL``) and the gpulab service
        (`service_url`). `NetworkUnusable` when one is not on loopback."""
        hub_url = self.hub_connect_url or (self.hub.api_url if self.hub else "")
        reach = [loopback_address(hub_url, "The hub's API")] if hub_url else []
        if self.service_url:
            reach.append(loopback_address(self.service_url, "The gpulab service"))
        return reach

    async def _join_person_network(self) -> None:
        """Join (or make) the person's namespace, open this server's relay and choose its port
        (one free on both sides, unless the operator chose a port); ``_netns_fd`` is then
        open for preexec."""
        try:
            reach = self.person_network_reach()
        except NetworkUnusable as e:
            raise SpawnRefused(500, f"Your server cannot start: {e}. Tell the hub's "
                               "admin.") from e
        nets = PersonNetworks.for_loop()
        name = self.person_unit
        self._netns_name = name
        configured = any("port" in self.config.get(c, {}) for c in
                         ("Spawner", "LocalProcessSpawner", "LocalGPUSpawner"))
        try:
            path = await nets.join(name, self.name, reach, egress=self._egress())
            self.port = await nets.open_server(name, self.name, self.ip or "127.0.0.1",
                                               self.port if configured else 0)
            self._netns_fd = await asyncio.to_thread(sandbox.open_netns, path.name, path.parent)
        except OSError as e:
            raise SpawnRefused(500, "The network of your server could not be set up: "
                               f"{e.strerror or e}. Tell the hub's admin.") from e
        self.log.info("%s runs in network namespace %s on %s:%s", self._log_name, name,
                      self.ip or "127.0.0.1", self.port)

    def _egress(self):
        """The networks the person's egress proxy refuses besides the built-in ones; None: no
        proxy (`notebook_egress` off)."""
        return egress.parse_networks(self.egress_refused_networks) if self.notebook_egress \
            else None

    def egress_env(self) -> dict[str, str]:
        """The proxy variables of a server whose person's namespace has an egress proxy."""
        if not (self.private_network and self.notebook_egress and self._netns_name):
            return {}
        try:
            proxy = PersonNetworks.for_loop().proxy_address(self._netns_name)
        except RuntimeError:  # (no running loop: not a start)
            return {}
        if proxy is None:
            return {}
        try:
            direct = [h for h, _ in self.person_network_reach()]
        except NetworkUnusable:
            direct = []
        # (an operator's own `environment` wins, e.g. a proxy of their site)
        return {k: v for k, v in egress.proxy_env(proxy, direct).items()
                if k not in self.environment}

    async def _leave_person_network(self) -> None:
        """This server is gone: its relay closes; with the person's last server, the
        namespace goes."""
        name, self._netns_name = self._netns_name, None
        if not name:
            return
        try:
            if await PersonNetworks.for_loop().leave(name, self.name):
                self.log.info("Removed network namespace %s (%s's last server stopped)",
                              name, self.user.name)
        except OSError:
            self.log.exception("Could not remove the network namespace %s", name)

    async def _adopt_person_network(self) -> None:
        """A server found running (a new hub, its state from the one before): its relays
        again, in the namespace it still runs in."""
        nets = PersonNetworks.for_loop()
        if nets.has(self._netns_name, self.name):
            return
        # where the proxy sends its requests: the hub's record (``port`` is not in the
        # spawner's state)
        server = self.server
        ip = (server.ip if server is not None and server.ip else self.ip) or "127.0.0.1"
        port = server.port if server is not None and server.port else self.port
        if not port:
            self.log.error("%s runs in network namespace %s on no known port", self._log_name,
                           self._netns_name)
            return
        try:
            await nets.join(self._netns_name, self.name, self.person_network_reach(),
                            adopt=True, egress=self._egress())
            self.port = await nets.open_server(self._netns_name, self.name, ip, port)
            self.log.info("Relays of %s in network namespace %s set up again",
                          self._log_name, self._netns_name)
        except (OSError, NetworkUnusable) as e:
            self.log.error("%s runs in network namespace %s, which cannot be reached: %s",
                           self._log_name, self._netns_name, e)

    #: the folder `create_certs` made for this start's key and certificate (`move_certs`
    #: removes it once it has handed them to the server's account)
    _cert_scratch: Path | None = None

    async def create_certs(self):
        """The server's key and certificate (internal_ssl), signed by the hub's notebooks CA.

        JupyterHub's own writes ``user-<name>`` in the hub's certificate store: one pair of
        files (and one shared ``certipy.json``) for all of a person's servers, so two servers
        of one person started at once overwrote each other's key while the first was being
        moved (and deleted) — a 500 for the other; and the name is the certificate's common
        name, which may hold at most 64 characters, so nobody whose name had more than 59
        could start a server. Here every start gets a folder of its own in the store (only
        the CA's record is read from the store, nothing of it written), and the common name
        is ``user-`` and the name's `safe_slug` (hashed past 59 characters). The hub and the
        proxy check a server's certificate against the CA and its subject alternative names
        (`ssl_alt_names`: the address it listens on), never the common name. The key is
        ECDSA P-256 (`server_key_pair`), signed by the RSA CA; it is made in a thread.
        """
        from certipy import Certipy

        self._assign_server_ip()  # the certificate names the address the server listens on
        alt_names = self.ssl_alt_names
        if callable(alt_names):
            alt_names = alt_names(self)
            if inspect.isawaitable(alt_names):
                alt_names = await alt_names
        alt_names = list(alt_names)
        if self.ssl_alt_names_include_local:
            alt_names = ["DNS:localhost", "IP:127.0.0.1", *alt_names]
        self.log.info("Creating certs for %s: %s", self._log_name, ";".join(alt_names))
        ca = "notebooks-ca"
        common_name = "user-" + safe_slug(self.user.name or "service", 64 - len("user-"))
        store = self.internal_certs_location

        def make() -> tuple[Path, dict]:
            record = Certipy(store_dir=store).store.get_record(ca)
            scratch = Path(tempfile.mkdtemp(prefix="server-", dir=store))
            try:
                own = Certipy(store_dir=str(scratch))
                # an ECDSA P-256 key, not certipy's RSA-2048: made in 0.1 ms instead of
                # 0.1-1 s of CPU, which a storm of 200 spawns queued behind (issue 40)
                own.create_key_pair = server_key_pair
                own.store.store[ca] = record  # read only: its signees are not the hub's
                pair = own.create_signed_pair(common_name, ca, alt_names=alt_names)
            except BaseException:
                shutil.rmtree(scratch, ignore_errors=True)
                raise
            return scratch, {"keyfile": pair["files"]["key"], "certfile": pair["files"]["cert"],
                             "cafile": self.internal_trust_bundles[ca]}

        self._cert_scratch, paths = await asyncio.to_thread(make)
        return paths

    def user_env(self, env):
        if self.isolate_users:
            entry = pwd.getpwnam(self.system_user)
            env["USER"] = entry.pw_name
            env["HOME"] = entry.pw_dir
            env["SHELL"] = entry.pw_shell or "/bin/bash"
        else:
            env["HOME"] = self.home_dir
        return env

    def get_args(self):
        args = super().get_args()
        if not self.isolate_users and os.geteuid() == 0:
            # the operator chose --no-isolation as root: Jupyter Server refuses root otherwise
            args.append("--ServerApp.allow_root=True")
        if self.kernels_over_unix_sockets:
            # kernels on Unix sockets in the server's own runtime folder, never on TCP ports
            # anyone on the machine can connect to (the command line beats config files)
            args.append("--KernelManager.transport=ipc")
        return args

    def get_env(self):
        env = super().get_env()
        bindir = os.path.dirname(sys.executable)
        env["PATH"] = bindir + os.pathsep + env.get("PATH", os.defpath)
        env.update(self.gpu_env())
        # tf.keras in notebooks is tf-keras 2, the Keras training jobs run (the runtime sets
        # the same): code tried in a notebook behaves the same in a job (an operator's
        # `environment` setting wins)
        if "TF_USE_LEGACY_KERAS" not in self.environment:
            env["TF_USE_LEGACY_KERAS"] = "1"
        # simulated GPUs: TensorFlow runs on the CPU and looks for no CUDA driver, whose
        # absence it would log as an error ("failed call to cuInit"), as in training jobs
        inventory = list(self.gpu_inventory)
        if (inventory and all(g.simulated for g in inventory)
                and "TF_ENABLED_DEVICE_TYPES" not in self.environment):
            env["TF_ENABLED_DEVICE_TYPES"] = "CPU"
        if self.shared_dir:
            env["GPULAB_SHARED_DIR"] = self.shared_dir
            env["GPULAB_USER_DIR"] = str(self.user_folder)
            env["GPULAB_DATASETS_DIR"] = str(Path(self.shared_dir) / "datasets")
        if self.service_url:
            env["GPULAB_SERVICE_URL"] = self.service_url
        env.update(self.kernel_env())
        env.update(self.egress_env())
        return env

    def kernel_env(self) -> dict[str, str]:
        """With `kernels_over_unix_sockets` and `private_tmp`: the kernels' sockets and
        connection files go inside the server's private /tmp (``JUPYTER_RUNTIME_DIR``, a
        short path: a Unix socket's is at most 107 bytes; Jupyter makes the folder 0700)."""
        if self.private_tmp and self.kernels_over_unix_sockets:
            return {"JUPYTER_RUNTIME_DIR": SERVER_RUNTIME_DIR}
        return {}

    async def move_certs(self, paths):
        """Hand the server's TLS key, certificate and CA bundle (internal_ssl) to its account.

        LocalProcessSpawner looks the account up by the hub user's name and moves the files
        into that account's home as root, following whatever links the user left there. Here
        the account is `system_user` (made first if this is its first spawn), and the files
        are written by root, without following links, into
        ``<data>/server-certs/<user>.<server>/``: a folder of root's that only the account's
        group may read (0750, files 0640), so nobody else can read the key and the user
        cannot swap anything in. Without isolation the group is the hub account's.
        """
        scratch, self._cert_scratch = self._cert_scratch, None
        try:
            return await self._move_certs(paths)
        finally:
            if scratch is not None:  # create_certs' folder: the hub keeps no copy of the key
                await asyncio.to_thread(shutil.rmtree, scratch, True)

    async def _move_certs(self, paths):
        await self._prepare_account_or_refuse()
        gid = pwd.getpwnam(self.system_user).pw_gid
        base = Path(self.server_certs_dir or Path(self.internal_certs_location).absolute()
                    .with_name("server-certs"))
        folder = base / server_stem(self.user.name, self.name)

        def install() -> dict:
            base.mkdir(mode=0o711, exist_ok=True)
            os.chmod(base, 0o711)
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(mode=0o700)
            out = {}
            for key, mode in (("keyfile", 0o640), ("certfile", 0o644), ("cafile", 0o644)):
                src = Path(paths[key])
                dst = folder / src.name
                fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(src.read_bytes())
                    os.fchown(f.fileno(), os.geteuid(), gid)
                    os.fchmod(f.fileno(), mode)
                out[key] = str(dst)
            os.chown(folder, os.geteuid(), gid)
            os.chmod(folder, 0o750)
            for key in ("keyfile", "certfile"):  # the hub keeps no copy of a server's key
                Path(paths[key]).unlink(missing_ok=True)
            return out

        return await asyncio.to_thread(install)

    def gpu_probe(self):
        return lambda: pid_alive(self.pid)

    def _apply_profile(self, selection: Selection) -> GPUProfile:
        """Set the overrides of the chosen profile and options, undoing those of a previous
        start first; returns the profile with the GPUs of the final overrides."""
        profile = selection.profile
        kube_only = sorted({k for o in selection.overrides[1:] for k in o}
                           - set(_PROFILE_TRAITS) - set(_GPU_KEYS))
        if kube_only:
            raise SpawnRefused(400, f"Profile '{profile.display_name}': the options chosen set "
                               f"{', '.join(kube_only)}, which only a server on Kubernetes can "
                               "use; this hub starts servers on its own machine.")
        self.gpu_undo_overrides()
        before = self.gpu_traits_before(_PROFILE_TRAITS)
        final = merge_overrides({**before, "extra_resource_limits": {}, "node_selector": {}},
                                selection.overrides, evaluate=self)
        try:
            for name in _PROFILE_TRAITS:
                setattr(self, name, final[name])
            gpus, model = gpu_request(final, f"profile '{profile.display_name}'")
        except (TraitError, ProfileError) as e:
            for name, value in before.items():
                setattr(self, name, value)
            raise SpawnRefused(400, f"Profile '{profile.display_name}' cannot start with the "
                               f"options chosen: {e}") from e
        self.gpu_record_overrides(before)
        return dataclasses.replace(profile, gpus=gpus, model=model)

    def _prepare_account(self, groups: tuple[str, ...] = ()) -> None:
        """The person's account and folder, and their disk where a quota gives them one (in
        a worker thread; one person's concurrent starts one after the other,
        `account_lock`)."""
        with account_lock(self.system_user):
            owner = None
            if self.isolate_users:
                owner = ensure_account(self.system_user, self.user.name)
            elif self.home_dir_template:
                Path(self.home_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
            if self.shared_dir:
                prepare_user_folder(self.user_folder, owner)
                if owner is not None:
                    self._prepare_disk(owner, groups)

    def _prepare_disk(self, owner, groups: tuple[str, ...]) -> None:
        """Their folder on their own disk of the size their quota's ``disk`` says
        (`gpulab.hub.machine.userdisk`), mounted before the server starts; none without a limit."""
        disks = PersonDisks(self.gpu_ledger, self.shared_dir, lambda _user: owner)
        done = disks.prepare(self.user.name, groups)
        if done:
            self.log.info("Disk of %s: %s", self._log_name, done)

    async def _prepare_account_or_refuse(self) -> None:
        """`_prepare_account` in a thread; a refused spawn (`SpawnRefused`) if it fails,
        403 when the account or folder belongs to somebody else."""
        groups = tuple(g.name for g in self.user.groups)  # the hub's ORM: on the event loop
        try:
            await asyncio.to_thread(self._prepare_account, groups)
        except AccountConflict as e:
            self.log.error("Refused to start %s: %s", self._log_name, e)
            raise SpawnRefused(403, f"Your server cannot start: {e}.") from e
        except AccountError as e:
            raise SpawnRefused(500, f"Your server could not be prepared: {e}") from e
        except DiskError as e:
            self.log.error("Refused to start %s: its disk: %s", self._log_name, e.message)
            raise SpawnRefused(e.status, f"Your server cannot start: your disk on the shared "
                               f"storage: {e.message}") from e

    async def start(self):
        # a server reads nothing from the terminal `gpulab up` runs in: it is another
        # person's process (it could read what the operator types), and Jupyter asks there
        # whether to shut down on Ctrl-C, which held every stop 10 s (the operator's own
        # popen_kwargs still win)
        self.popen_kwargs = {"stdin": subprocess.DEVNULL, **self.popen_kwargs}
        self._assign_server_ip()
        try:
            profile = self._apply_profile(self.gpu_selection())
            self._gpu_queue_admitted = False
            gpus = await self.admit_gpus(profile)
        finally:
            self._gpu_restore_start_timeout()  # JupyterHub has read it: the operator's again
        try:
            await self._prepare_account_or_refuse()
            try:
                self._server_group = await asyncio.to_thread(
                    self._make_server_group, [g.index for g in gpus])
            except OSError as e:
                raise SpawnRefused(500, "The control group of your server (CPU, memory and GPU "
                                   f"limits) could not be set up: {e.strerror or e}. Tell the "
                                   "hub's admin.") from e
            if self._server_group is None and self.private_tmp:
                self._cgroup_unit = self.cgroup_unit  # the private /tmp is still this unit's
            try:
                self._tmp_folder = await asyncio.to_thread(self._make_tmp_folder)
            except OSError as e:
                raise SpawnRefused(500, "The private /tmp of your server could not be made: "
                                   f"{e.strerror or e}. Tell the hub's admin.") from e
            if self.private_network:
                await self._join_person_network()
            log_file = None
            if self.server_log_dir:
                path = Path(self.server_log_dir) / f"{server_stem(self.user.name, self.name)}.log"
                log_file = await asyncio.to_thread(_open_log, Path(self.server_log_dir), path)
                self.popen_kwargs = {**self.popen_kwargs, "stdout": log_file, "stderr": log_file}
            try:
                url = await super().start()
            finally:
                if log_file is not None:
                    log_file.close()
        except BaseException:
            await asyncio.to_thread(self._remove_server_group)
            await self._leave_person_network()
            await self.release_gpus_async("server did not start")
            await self._gpu_forget_queue_entry("server did not start")
            raise
        finally:
            if self._netns_fd is not None:  # (the server's process has joined it)
                os.close(self._netns_fd)
                self._netns_fd = None
        if self.gpu_claim_id:
            self.set_gpu_probe()
        self.log.info(
            "Started %s as %s on GPUs [%s] (profile %s)",
            self._log_name,
            self.system_user,
            ",".join(str(g.index) for g in gpus),
            profile.slug,
        )
        return url


def server_key_pair(cert_type=None, bits=None):
    """A server's internal-TLS key: ECDSA on P-256 (certipy's ``create_key_pair`` hook, whose
    RSA-2048 keys took 0.1-1 s of CPU each on a busy machine: bench/scale.py's storm of 200
    spawns spent half the hub's samples there). TLS 1.2 and 1.3 take an ECDSA server key
    under an RSA CA; the hub, the proxy and the server read it like any PEM key."""
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _leave_queue(queue: Queue, ledger: Ledger, request: Request, entry_id: str,
                 reason: str) -> None:
    """A waiting start ended (sync; in a thread): its entry leaves the line, and an allocation
    admitted to it meanwhile is closed (a pass that admitted it either committed before the
    entry was cancelled, then its allocation is read here, or sees it cancelled)."""
    queue.forget(request.user, "notebook", request.holder, reason)
    entry = queue.get(entry_id)
    if entry is not None and entry.allocation_id:
        ledger.release(entry.allocation_id, "server did not start")


def server_ip(spawner_id: int) -> str:
    """The loopback address of the server whose hub id is `spawner_id` (1, 2, ...).

    Injective: ids run through 127.1.0.1, ..., 127.1.0.254, 127.1.1.1, ... up to
    127.255.255.254 (16,581,120 servers), skipping host parts ``.0`` and ``.255`` (a network
    or broadcast address to some tools) and all of 127.0.0.x (the hub's own services).
    """
    if spawner_id < 1:
        raise ValueError(f"a hub's server id starts at 1, not {spawner_id}")
    k, d = divmod(spawner_id - 1, 254)
    b, c = divmod(k, 256)
    if b > 254:
        raise ValueError(f"server id {spawner_id} is beyond the 127.0.0.0/8 addresses")
    return f"127.{b + 1}.{c}.{d + 1}"


def _open_log(folder: Path, path: Path):
    """The server's log file, private to the hub's account (0600 in a 0700 folder)."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "ab", buffering=0)
