"""The cluster substrate that notebook servers and training jobs both stand on (Kubernetes
mode): user namespaces, their policies and quotas (`namespaces`), the Kubernetes objects
(`kubeobjects`), Kueue's objects (`kueueobjects`) and the mirror of the quota ledger into them
(`kueuemirror`), and the settings both share (`settings`). Imported by `gpulab.spawner` and
`gpulab.hub.jobs`, never the reverse."""
