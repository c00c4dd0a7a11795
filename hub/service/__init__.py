"""The gpulab service: a JupyterHub managed service at ``/services/gpulab/`` with the REST API
(quotas, holdings, usage, training jobs), the user and admin pages, and the reconciler that
closes allocations of servers the hub no longer has. ``python -m gpulab.hub.service``.

The names below are what the hub's configuration needs of the service; this module imports
nothing, so the configuration builders can use them without importing tornado's handlers.
"""

SERVICE_NAME = "gpulab"
#: the custom scope that lets a token see other people and change quotas
ADMIN_SCOPE = "custom:gpulab:admin"
ACCESS_SCOPE = f"access:services!service={SERVICE_NAME}"
#: the environment variable with the seconds between two runs of the reconciler (0: never)
RECONCILE_ENV = "GPULAB_RECONCILE_SECONDS"
#: the environment variable with the seconds between two reads of GPU usage (0: not read)
USAGE_ENV = "GPULAB_USAGE_SECONDS"
