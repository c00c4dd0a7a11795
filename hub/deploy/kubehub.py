"""``python3 -m gpulab.hub.deploy.kubehub``: the hub of the z2jh chart, JupyterHub with gpulab's
guard against pages of people's servers (issue 33.3).

helm-values/values.yaml starts it in place of the chart's ``jupyterhub`` (``hub.args``, with
the chart's own config file); everything else is the chart's JupyterHub, configured by its
``jupyterhub_config.py`` and gpulab's `gpulab.hub.deploy.kubernetes.kubernetes_config`. With
``hub.config.JupyterHub.subdomain_host`` each server has an origin of its own and the hub's
static files are shared with the service's host; without it, the hub refuses the requests it
can tell a server's page sent (`gpulab.hub.deploy.userpages`), as ``gpulab up`` does.
"""

from __future__ import annotations

from jupyterhub.app import JupyterHub

from gpulab.hub.deploy.userpages import refuse_user_pages_trait, user_pages_application


class GpulabKubeHub(JupyterHub):
    """JupyterHub whose Tornado application is gpulab's (`user_pages_application`)."""

    refuse_user_pages = refuse_user_pages_trait()

    def init_tornado_application(self):
        app = user_pages_application(self, self.refuse_user_pages)
        if app is None:
            return super().init_tornado_application()
        self.tornado_application = app


main = GpulabKubeHub.launch_instance

if __name__ == "__main__":
    main()
