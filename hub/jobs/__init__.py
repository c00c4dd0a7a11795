"""Training jobs: the spec a user submits (`spec`), the job tables, and one workflow for
submitting, supervising, stopping and recovering jobs (`base`) with two drivers: local
processes under the users' accounts (`local`) and Kubernetes Jobs (`kube`, its objects built
by `kubeobjects`)."""
