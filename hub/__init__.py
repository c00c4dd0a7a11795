"""The hub side of gpulab, in layers; each imports only the layers above it in this list.

``db``         the SQL database's engine and migrations (the ledger's and the jobs' tables)
``quota``      the quota policy (pure) and the ledger that admits and releases GPUs
``jobs``       training jobs: the spec, one workflow (`gpulab.hub.jobs.base.JobBackend`) and
               its two drivers, local processes and Kubernetes
``service``    the gpulab service: a JupyterHub service with the REST API and the pages
``deploy``     the local and Kubernetes configuration builders, login, OIDC, the culler
``cli``        the ``gpulab`` command

`gpulab.spawner` (the hub's spawners) sits between ``quota`` and ``jobs``;
`gpulab.extensions` (what runs in notebook servers and training replicas) imports nothing
of the hub's. ``tests/unit/test_layers.py`` holds these rules.

``gpulab.hub.kubeconfig`` and ``gpulab.hub.oidc`` are the names configurations use (the helm
values, ``jupyterhub_config.py``); they are `gpulab.hub.deploy`'s.
"""
