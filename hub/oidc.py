"""``from gpulab.hub.oidc import oidc_config``: the name configurations use for
`gpulab.hub.deploy.oidc.oidc_config`."""

from gpulab.hub.deploy.oidc import oidc_config  # noqa: F401
