"""The gpulab service: a JupyterHub managed service at ``/services/gpulab/`` with the REST API
(quotas, holdings, usage, training jobs), the user and admin pages, and the reconciler that
closes allocations of servers the hub no longer has.
``python -m gpulab.hub.service --config=<file>``.

The names below are what the hub's configuration needs of the service, and `exit_at_once`;
this module imports only the standard library, so the configuration builders can use them without importing tornado's handlers.
"""

import atexit
import os
import sys


SERVICE_NAME = "gpulab"
#: the custom scope that lets a token see other people and change quotas
ADMIN_SCOPE = "custom:gpulab:admin"
ACCESS_SCOPE = f"access:services!service={SERVICE_NAME}"
#: the environment variable with the seconds between two runs of the reconciler (0: never)
RECONCILE_ENV = "GPULAB_RECONCILE_SECONDS"
#: the environment variable with the seconds between two reads of GPU usage (0: not read)
USAGE_ENV = "GPULAB_USAGE_SECONDS"
#: each setting of the service (a `gpulab.hub.service.app.GpulabService` trait) and the
#: environment variable it falls back to when no config file or command line sets it
ENV_FALLBACKS = {
    "ledger_url": "GPULAB_LEDGER_URL",
    "ledger_pool": "GPULAB_LEDGER_POOL",
    "job_limits": "GPULAB_JOB_LIMITS",
    "reconcile_seconds": RECONCILE_ENV,
    "usage_seconds": USAGE_ENV,
    "usage_source": "GPULAB_USAGE_SOURCE",
    "idle": "GPULAB_IDLE",
    "job_backend": "GPULAB_JOB_BACKEND",
    "kube_jobs": "GPULAB_KUBE_JOBS",
    "shared_dir": "GPULAB_SHARED_DIR",
    "isolate": "GPULAB_ISOLATE",
    "user_prefix": "GPULAB_USER_PREFIX",
    "job_python": "GPULAB_JOB_PYTHON",
    "queue": "GPULAB_QUEUE",
    "ssl_keyfile": "GPULAB_SSL_KEYFILE",
    "ssl_certfile": "GPULAB_SSL_CERTFILE",
    "ssl_client_ca": "GPULAB_SSL_CLIENT_CA",
    "ssl_hub_ca": "GPULAB_SSL_HUB_CA",
}


def exit_at_once(code: int) -> None:
    """End the process now that everything is stopped and written (the hub after its
    clean-up, the gpulab service after its loop): the exit handlers run
    (JupyterHub's, logging's last flush), but not the interpreter's teardown of every module
    and object, which took 1 to 3 s after the hub's "...done" on a loaded two-core machine
    (bench/startup.py), the larger part of a Ctrl-C."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)

