"""`ServiceTLS`: the gpulab service's side of the hub's internal TLS."""

from __future__ import annotations

import os
import ssl

from tornado.httpclient import AsyncHTTPClient

from gpulab.hub.service import ENV_FALLBACKS

class ServiceTLS:
    """The service's side of the hub's internal TLS, from what the hub gives it
    (`GpulabService`'s ``ssl_*`` settings, each falling back to the variable named here).

    ``GPULAB_SSL_KEYFILE`` / ``GPULAB_SSL_CERTFILE``: the service's own key and certificate,
    signed by the hub's CA (`gpulab.hub.deploy.localhub.service_certificate`), served to every client and
    shown to the hub as a client certificate; ``GPULAB_SSL_CLIENT_CA``: the bundle of the hub's
    internal CAs, the only clients accepted (the hub, the proxy, notebook servers' kernels with
    their server's certificate); ``GPULAB_SSL_HUB_CA``: the hub's CA alone, the only one that
    may answer for the hub's API. Without them (the service run without ``internal_ssl``) the
    service speaks plain HTTP as before.
    """

    def __init__(self, keyfile: str, certfile: str, client_ca: str, hub_ca: str):
        self.keyfile, self.certfile, self.client_ca, self.hub_ca = keyfile, certfile, client_ca, hub_ca

    @classmethod
    def from_settings(cls, keyfile: str, certfile: str, client_ca: str,
                      hub_ca: str) -> "ServiceTLS | None":
        """From `GpulabService`'s ``ssl_*`` settings: None when all four are empty, an error
        naming the missing ones when only some are set."""
        values = (keyfile, certfile, client_ca, hub_ca)
        if not any(values):
            return None
        missing = [f"GpulabService.ssl_{n} (${ENV_FALLBACKS['ssl_' + n]})"
                   for n, v in zip(("keyfile", "certfile", "client_ca", "hub_ca"), values) if not v]
        if missing:
            raise RuntimeError("Incomplete TLS settings for the gpulab service: "
                               + ", ".join(missing) + " not set")
        return cls(*values)

    @classmethod
    def from_env(cls, env=None) -> "ServiceTLS | None":
        env = os.environ if env is None else env
        return cls.from_settings(*(env.get(ENV_FALLBACKS["ssl_" + n], "")
                                   for n in ("keyfile", "certfile", "client_ca", "hub_ca")))

    def server_context(self):
        """TLS for the service's port: its certificate, and a client certificate of one of
        the hub's CAs required from every client."""
        from jupyterhub.utils import make_ssl_context

        return make_ssl_context(self.keyfile, self.certfile, cafile=self.client_ca,
                                purpose=ssl.Purpose.CLIENT_AUTH)

    def hub_auth_kwargs(self) -> dict:
        return {"keyfile": self.keyfile, "certfile": self.certfile, "client_ca": self.hub_ca}

    def configure_http_client(self) -> None:
        """Every call of this process to the hub (users, groups, servers) verifies the hub."""
        AsyncHTTPClient.configure(None, defaults={
            "ca_certs": self.hub_ca, "client_key": self.keyfile, "client_cert": self.certfile,
            "validate_cert": True})
