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
