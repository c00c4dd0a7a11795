"""``from gpulab.hub.kubeconfig import kubernetes_config``: the name the helm values use for
`gpulab.hub.deploy.kubernetes.kubernetes_config`."""

from gpulab.hub.deploy.kubernetes import kubernetes_config  # noqa: F401
