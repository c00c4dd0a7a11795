"""The gpulab service's jobs API from Python: what notebooks, the widgets and the magic call.

    from gpulab.extensions.client import Client
    gl = Client()                          # inside a hub server: configured from the environment
    job = gl.submit(name="digits", strategy="parameter-server", ps=1, workers=2, gpus=1,
                    source=open("train.py").read())
    job.status()["state"]                  # Admitted, Starting, Running, Succeeded, Failed, Stopped
    for text in job.logs("chief-0", follow=True):
        print(text, end="")
    job.wait(timeout=600); job.stop()
    gl.me()["quota_text"], gl.holdings()

Where the service is (`service_url_from_env`), first match wins:

1. ``GPULAB_SERVICE_URL``: the service's own base URL (``…/services/gpulab/``);
2. ``GPULAB_URL``: the hub's address, as for the ``gpulab`` CLI (``http://127.0.0.1:8000``);
3. ``JUPYTERHUB_PUBLIC_HUB_URL`` (set by JupyterHub when the hub has a ``public_url``),
   without its ``hub/``;
4. ``http://127.0.0.1:8000``, the address `gpulab up` listens on by default.

The hub's internal API address (``JUPYTERHUB_API_URL``) is not used: the hub does not route
``/services/``, only the proxy does.

A hub with services on hosts of their own (``gpulab up --subdomain-host``, JupyterHub's
``subdomain_host``) has no ``/services/gpulab/`` on its own host: asked there, it redirects to
``/hub/services/…`` (or refuses a POST with a page). Given only the hub's address (2.-4., or
``hub_url=``), the client then finds the service where JupyterHub puts it,
``<scheme>://gpulab--service.<hub host>[:port]/services/gpulab/`` (`find_service`; the host
taken from the hub's redirect, so ``http://127.0.0.1:8000`` works too), and remembers it for
the rest of the process. ``localhost`` and every ``*.localhost`` name are the loopback
addresses for this client's own connections (RFC 6761; browsers and curl resolve them so,
Python's resolver does not know the subdomains): ``http://gpulab--service.localhost:8000``
works from Python too. Other names resolve as always, and nothing outside this client's
requests is changed. The token is ``GPULAB_TOKEN``, else the server's own
``JUPYTERHUB_API_TOKEN`` (its ``server`` role may call the gpulab service).

Over ``https`` the service's certificate is verified before the token is sent (`ssl_context`):
inside a hub server with the hub's internal TLS, against the CA bundle the hub gave the server
(``JUPYTERHUB_SSL_CLIENT_CA``: the hub's own CAs, never the CA of users' servers), and the
server's certificate is shown as the client's; elsewhere against the system's CAs. Whoever
listens on the service's port without the hub's certificate gets a refused handshake, no token.

Every error answer of the service (``{"status", "message", "field"?}``) becomes a
`GpulabError` whose message is the service's own. Standard library only (no tornado, no
ipywidgets): this module also runs where a job's code runs.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import os
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from typing import Iterator, Mapping
from urllib.parse import quote, urlencode, urljoin, urlsplit

from traitlets import Float, Unicode, default, validate
from traitlets.config import Configurable

from . import joblog, jobmodel
from .contract import ACTIVE, FINAL
from .contract import lead_replica as _lead_of_strategy

DEFAULT_HUB_URL = "http://127.0.0.1:8000"
#: the gpulab service's name in the hub (gpulab.hub.service.SERVICE_NAME) and its URL path
SERVICE_NAME = "gpulab"
SERVICE_PATH = f"services/{SERVICE_NAME}/"
API_PATH = "api/v1/"
#: a job's states (the job contract's names, kept here for the client's users)
ACTIVE_STATES, FINAL_STATES = ACTIVE, FINAL
#: the service waits up to 20 s for more log with ``follow=1``
FOLLOW_TIMEOUT = 60.0


class GpulabError(Exception):
    """An error answer of the gpulab service, or no answer at all.

    ``message`` is for people (the service's own words); ``status`` the HTTP status (None when
    the service could not be reached); ``field`` the part of the request at fault, when the
    service names one (``name``, ``replicas.worker``, ``resources``, ``script``…).

    For callers that word errors their own way (the ``gpulab`` command), ``kind`` says what
    went wrong: ``"refused"`` (an error answer with the service's own message), ``"status"``
    (an error answer without one: ``reason`` is the HTTP reason phrase), ``"unreachable"``
    (``reason`` is the network's), ``"not-json"``, ``"no-token"``, ``"elsewhere"`` (the hub
    keeps the service on a host of its own that could not be found or reached: the message says
    what to do, `Client.find_service`); ``address`` is where the
    request went (the service's base URL, or the URL given to `Client.call`).
    """

    def __init__(self, message: str, status: int | None = None, field: str | None = None, *,
                 kind: str = "refused", reason: str | None = None, address: str | None = None):
        super().__init__(message)
        self.message, self.status, self.field = message, status, field
        self.kind, self.reason, self.address = kind, reason, address

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"GpulabError({self.message!r}, status={self.status!r}, field={self.field!r})"


def service_url_from_env(env: Mapping[str, str] | None = None) -> str:
    """The gpulab service's base URL (ending in ``/services/gpulab/``) from the environment."""
    env = os.environ if env is None else env
    explicit = env.get("GPULAB_SERVICE_URL")
    if explicit:
        return explicit.rstrip("/") + "/"
    hub = env.get("GPULAB_URL")
    if not hub:
        public = env.get("JUPYTERHUB_PUBLIC_HUB_URL", "").rstrip("/")
        hub = public[: -len("/hub")] if public.endswith("/hub") else public
    return (hub or DEFAULT_HUB_URL).rstrip("/") + "/" + SERVICE_PATH


def service_host(hub_host: str) -> str:
    """The gpulab service's host name on a hub with services on hosts of their own
    (``subdomain_host`` on `hub_host`): JupyterHub's default ``subdomain_hook`` ("idna"),
    ``<name>--service.<domain>``; the name ``gpulab`` is a DNS label as it is."""
    return f"{SERVICE_NAME}--service.{hub_host.rstrip('.').lower()}"


def is_loopback_name(host: str) -> bool:
    """``localhost`` and its subdomains: loopback (RFC 6761), whatever DNS says."""
    name = (host or "").rstrip(".").lower()
    return name == "localhost" or name.endswith(".localhost")


def _connect(address, *args, **kwargs):
    """`socket.create_connection` for this client's connections: a ``*.localhost`` name (and
    ``localhost``) to 127.0.0.1, else ::1; any other name as the system resolves it."""
    host, port = address[0], address[1]
    if not is_loopback_name(host):
        return socket.create_connection(address, *args, **kwargs)
    first = None
    for ip in ("127.0.0.1", "::1"):
        try:
            return socket.create_connection((ip, port), *args, **kwargs)
        except OSError as e:
            first = first or e
    raise first


class _HTTPConnection(http.client.HTTPConnection):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._create_connection = _connect


class _HTTPSConnection(http.client.HTTPSConnection):
    # the certificate is still checked against the name asked (``self.host``), not the address
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._create_connection = _connect


class _HTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req):
        return self.do_open(_HTTPConnection, req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req):
        return self.do_open(_HTTPSConnection, req, context=self._context)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect becomes the `HTTPError` it is (how the hub says "not here")."""

    def redirect_request(self, *args, **kwargs):
        return None


def opener(context: ssl.SSLContext | None = None, follow: bool = True):
    """urllib's opener for this client's requests: loopback names (`is_loopback_name`) to
    loopback, `context` for ``https``, redirects followed unless not `follow`."""
    handlers = [_HTTPHandler, _HTTPSHandler(context=context)]
    return urllib.request.build_opener(*handlers, *(() if follow else (_NoRedirect,)))


#: where the service was found, by the base URL first tried (`Client.request`): per process
_FOUND: dict[str, str] = {}
_FOUND_LOCK = threading.Lock()


class _NotHere(Exception):
    """The hub answered for the service's path itself: it is not there (`find_service`)."""

    def __init__(self, status: int, location: str | None):
        super().__init__(status)
        self.status, self.location = status, location


def ssl_context(ca_file: str = "", client_cert: str = "", client_key: str = "") -> ssl.SSLContext:
    """TLS for calls to the service: its certificate and host name always verified, against
    `ca_file` ('' : the system's CAs); with `client_cert` and `client_key`, shown as ours."""
    ctx = ssl.create_default_context(cafile=ca_file or None)
    ctx.check_hostname = True
    ctx.verify_mode = ssl.CERT_REQUIRED
    if client_cert and client_key:
        ctx.load_cert_chain(client_cert, client_key)
    return ctx


def token_from_env(env: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if env is None else env
    return env.get("GPULAB_TOKEN") or env.get("JUPYTERHUB_API_TOKEN") or None


def lead_replica(view: Mapping) -> str:
    """The replica whose log and progress are the job's: the chief, or worker 0."""
    names = [r["name"] for r in view.get("replicas") or ()]
    for name in ("chief-0", "worker-0"):
        if name in names:
            return name
    if names:
        return names[0]
    return _lead_of_strategy(view.get("strategy") or "")


def with_chief(spec: Mapping) -> dict:
    """A copy of the job `spec` in which a parameter-server job without a ``chief`` in its
    ``replicas`` has one (``"chief": 1``; the service requires exactly 1). Other specs, and
    those that name a chief (whatever the number), are copied unchanged: the service judges
    them."""
    body = dict(spec)
    replicas = body.get("replicas", {})
    if body.get("strategy") == "parameter-server" and isinstance(replicas, Mapping) \
            and "chief" not in replicas:
        body["replicas"] = {"chief": 1, **replicas}
    return body


class Client(Configurable):
    """The gpulab service's API for one person (the token's owner).

    ``Client()`` inside a hub server; ``Client(url=…, token=…)`` elsewhere, where ``url`` is
    the service's base URL (``http://hub:8000/services/gpulab/``) or, with ``hub_url=``, the
    hub's address. As traitlets config: ``c.Client.url``, ``c.Client.token``,
    ``c.Client.timeout``.
    """

    url = Unicode(
        help="""The gpulab service's base URL, ending in ``/services/gpulab/``.

        Default: from the environment (see `service_url_from_env`): ``$GPULAB_SERVICE_URL``,
        else ``$GPULAB_URL`` (the hub's address) + ``/services/gpulab/``, else
        ``$JUPYTERHUB_PUBLIC_HUB_URL`` without ``hub/``, else ``http://127.0.0.1:8000``; from
        the hub's address (not ``$GPULAB_SERVICE_URL``, nor a URL given), the service is looked
        for on its own host where the hub keeps it there (`find_service`).
        Example: ``c.Client.url = "https://lab.example.org/services/gpulab/"``.""",
    ).tag(config=True)

    token = Unicode(
        help="""The hub API token sent with every request (never shown or logged).

        Default: ``$GPULAB_TOKEN``, else the server's own ``$JUPYTERHUB_API_TOKEN``.
        Example: ``c.Client.token = "<token from /hub/token>"``.""",
    ).tag(config=True)

    timeout = Float(
        30.0, help="""Seconds to wait for an answer to one request (default 30); following a
        log waits longer (the service holds such a request up to 20 s).
        Example: ``c.Client.timeout = 60``.""",
    ).tag(config=True)

    ca_file = Unicode(
        help="""CA bundle that must have signed the service's certificate (``https`` URLs).

        Default: ``$GPULAB_SERVICE_CA``, else ``$JUPYTERHUB_SSL_CLIENT_CA`` (inside a hub
        server with internal TLS: the hub's own CAs, which signed the service's certificate),
        else '' for the system's CAs (a hub with a public certificate).
        Example: ``c.Client.ca_file = "/etc/ssl/certs/lab-ca.pem"``.""",
    ).tag(config=True)

    client_cert = Unicode(
        help="""Certificate shown to the service (it asks one of the hub's internal clients).

        Default: the server's own, ``$JUPYTERHUB_SSL_CERTFILE`` (with
        ``$JUPYTERHUB_SSL_KEYFILE`` as `client_key`); '' shows none.
        Example: ``c.Client.client_cert = "/path/to/user.crt"``.""",
    ).tag(config=True)

    client_key = Unicode(
        help="""Key of `client_cert`. Default: ``$JUPYTERHUB_SSL_KEYFILE``.
        Example: ``c.Client.client_key = "/path/to/user.key"``.""",
    ).tag(config=True)

    @default("url")
    def _url_default(self) -> str:
        self._discover = not os.environ.get("GPULAB_SERVICE_URL")
        return service_url_from_env()

    @default("ca_file")
    def _ca_file_default(self) -> str:
        return os.environ.get("GPULAB_SERVICE_CA") or os.environ.get("JUPYTERHUB_SSL_CLIENT_CA", "")

    @default("client_cert")
    def _client_cert_default(self) -> str:
        return os.environ.get("JUPYTERHUB_SSL_CERTFILE", "")

    @default("client_key")
    def _client_key_default(self) -> str:
        return os.environ.get("JUPYTERHUB_SSL_KEYFILE", "")

    @default("token")
    def _token_default(self) -> str:
        return token_from_env() or ""

    @validate("url")
    def _url_slash(self, proposal) -> str:
        return proposal["value"].rstrip("/") + "/"

    #: whether `url` is the hub's address + ``/services/gpulab/`` (not one given as the
    #: service's own), so that the service may be looked for elsewhere (`find_service`)
    _discover = False

    def __init__(self, url: str | None = None, token: str | None = None, *,
                 hub_url: str | None = None, timeout: float | None = None, **kwargs):
        if url is None and hub_url is not None:
            url = hub_url.rstrip("/") + "/" + SERVICE_PATH
            self._discover = True
        for key, value in (("url", url), ("token", token), ("timeout", timeout)):
            if value is not None:
                kwargs[key] = value
        super().__init__(**kwargs)

    def __repr__(self) -> str:  # never the token
        return f"Client({self.url!r})"

    # -- HTTP ----------------------------------------------------------------------------

    def tls_context(self) -> ssl.SSLContext:
        """How an ``https`` service is verified (`ca_file`) and we are shown (`client_cert`)."""
        return ssl_context(self.ca_file, self.client_cert, self.client_key)

    def request_all(self, path: str, key: str, params: Mapping | None = None,
                    timeout: float | None = None, pages: int = 1000) -> list:
        """Every item of the list API ``path`` (its answer's `key`), page after page: the
        service pages its lists (``_pagination.next``), so a person with many jobs still
        gets them all. At most `pages` requests."""
        params, items = dict(params or {}), []
        for _ in range(pages):
            answer = self.request("GET", path, params=params, timeout=timeout)
            items.extend(answer.get(key) or [])
            nxt = (answer.get("_pagination") or {}).get("next")
            if not nxt:
                break
            params.update(offset=nxt["offset"], limit=nxt.get("limit", params.get("limit")))
        return items

    def request(self, method: str, path: str, body=None, params: Mapping | None = None,
                timeout: float | None = None):
        """One API call (``path`` below ``api/v1/``); the decoded JSON answer. The first call
        of a process to a hub whose service is on a host of its own finds it there
        (`find_service`)."""
        base = self.url
        if self._discover:
            with _FOUND_LOCK:
                found = _FOUND.get(base)
            if found is not None:
                self.url, self._discover = found, False
        if not self._discover:
            return self._send(method, self.url + API_PATH + path, body, params, timeout,
                              what=f"The gpulab service at {self.url}", address=self.url,
                              who="The gpulab service")
        try:
            answer = self._send(method, base + API_PATH + path, body, params, timeout,
                                what=f"The gpulab service at {base}", address=base,
                                who="The gpulab service", probe=True)
        except _NotHere as e:
            found = self.find_service(base, e.location)
            try:
                answer = self._send(method, found + API_PATH + path, body, params, timeout,
                                    what=f"The gpulab service at {found}", address=found,
                                    who="The gpulab service", probe=True)
            except _NotHere:
                raise GpulabError(
                    f"Neither {base} nor {found} is the gpulab service; set GPULAB_SERVICE_URL "
                    "to its address.", kind="elsewhere", reason="not the gpulab service",
                    address=base) from None
            except GpulabError as e2:
                if e2.kind in ("refused", "status"):
                    self._found(base, found)
                if e2.kind != "unreachable":
                    raise
                raise GpulabError(
                    f"The hub at {base[: -len(SERVICE_PATH)]} keeps its services on hosts of "
                    f"their own, and the gpulab service's, {found}, cannot be reached: "
                    f"{e2.reason}. Set GPULAB_SERVICE_URL to the service's address.",
                    kind="elsewhere", reason=e2.reason, address=found) from None
            self._found(base, found)
            return answer
        except GpulabError as e:
            if e.kind in ("refused", "status"):  # the service answered, with an error
                self._found(base, base)
            raise
        self._found(base, base)
        return answer

    def service_url(self) -> str:
        """The service's base URL, found first where only the hub's address was given (a GET
        of its ``openapi.json``); for links to its pages (``…/services/gpulab/admin``)."""
        if self._discover:
            try:
                self.request("GET", "openapi.json")
            except GpulabError:
                pass
        return self.url

    def _found(self, base: str, found: str) -> None:
        with _FOUND_LOCK:
            _FOUND[base] = found
        self.url, self._discover = found, False

    def find_service(self, base: str, location: str | None = None) -> str:
        """Where the service is when the hub at `base` (``<hub>/services/gpulab/``) answered
        that it is not there: JupyterHub's host for it (`service_host`) under the hub's host,
        which its redirect (`location`) names; without one, the hub is asked again (a GET of
        the service's path, which it redirects to ``/hub/services/…``). A redirect elsewhere
        than the hub's own pages (the hub moved, e.g. to ``https``) is followed instead."""
        hub = urlsplit(base)
        prefix = hub.path[: -len(SERVICE_PATH)] if hub.path.endswith(SERVICE_PATH) else "/"
        if location is None:
            try:
                self._send("GET", base, None, None, None, what=base, address=base, who=base,
                           probe=True, token=False)
            except _NotHere as e:
                location = e.location
            except GpulabError:
                pass
        there = urlsplit(urljoin(base, location)) if location else hub
        if location and not there.path.startswith(prefix.rstrip("/") + "/hub/"):
            return f"{there.scheme}://{there.netloc}{prefix.rstrip('/')}/{SERVICE_PATH}"
        host = there.hostname or ""
        try:
            ipaddress.ip_address(host)
        except ValueError:
            pass
        else:
            raise GpulabError(
                f"The hub at {base[: -len(SERVICE_PATH)]} has no gpulab service at {base} (it "
                "keeps its services on hosts of their own) and its address has no host name to "
                "find the service's under; use the hub's host name, or set GPULAB_SERVICE_URL "
                "to the service's address.", kind="elsewhere", reason="not the gpulab service",
                address=base)
        port = f":{there.port}" if there.port else ""
        return f"{there.scheme}://{service_host(host)}{port}{prefix.rstrip('/')}/{SERVICE_PATH}"

    def call(self, method: str, url: str, body=None, params: Mapping | None = None,
             timeout: float | None = None):
        """One request with this client's token and TLS checks to any address of the hub
        (``url`` whole, e.g. the hub's REST API ``…/hub/api/user``); the decoded JSON answer,
        or `GpulabError` (its ``kind``, ``reason`` and ``address`` let the caller word it)."""
        return self._send(method, url, body, params, timeout, what=url, address=url, who=url)

    def _send(self, method: str, url: str, body, params: Mapping | None,
              timeout: float | None, *, what: str, address: str, who: str,
              probe: bool = False, token: bool = True):
        """One request; with `probe`, redirects are not followed and the hub's own answer
        for the service's path (a redirect, a page) raises `_NotHere`."""
        if token and not self.token:
            raise GpulabError("No hub API token: set GPULAB_TOKEN (make one on the hub's Token "
                              "page, /hub/token), or run this inside a hub server.",
                              kind="no-token", address=address)
        query = {k: v for k, v in (params or {}).items() if v is not None}
        if query:
            url += ("&" if "?" in url else "?") + urlencode(query)
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if token:
            headers["Authorization"] = f"token {self.token}"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            # over https the certificate is checked in the handshake, before the token is sent
            context = self.tls_context() if url.startswith("https:") else None
            with opener(context, follow=not probe).open(
                    req, timeout=timeout or self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            if probe and 300 <= e.code < 400:
                raise _NotHere(e.code, e.headers.get("Location")) from None
            error = _api_error(e, address, who)
            if probe and e.code in (403, 404) and error.kind == "status":  # a page, not JSON
                raise _NotHere(e.code, None) from None
            raise error from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", None) or e
            raise GpulabError(f"{what} cannot be reached: {reason}.", kind="unreachable",
                              reason=str(reason), address=address) from e
        try:
            return json.loads(raw or b"null")
        except ValueError as e:
            raise GpulabError(f"{what} answered something that is not JSON; is this the "
                              "right address?", kind="not-json", address=address) from e

    # -- the person ----------------------------------------------------------------------

    def me(self) -> dict:
        """Quota (``quota``, ``quota_text``), ``holdings``, ``gpus_held``, ``inventory``
        (``total``, ``free``, ``simulated``) and GPU-hours of the token's owner."""
        return self.request("GET", "me")

    def quota(self) -> dict:
        """The parts of `me` about GPUs: quota, quota_text, gpus_held, holdings, inventory."""
        me = self.me()
        return {k: me.get(k) for k in ("quota", "quota_text", "gpus_held", "holdings",
                                       "inventory")}

    def holdings(self) -> list[dict]:
        """What holds this person's GPUs now: ``kind`` (notebook, job), ``name``, ``gpus``…"""
        return self.me().get("holdings") or []

    # -- jobs ----------------------------------------------------------------------------

    def jobs(self, user: str | None = None, *, everyone: bool = False) -> list[dict]:
        """This person's jobs, newest first (admins: another ``user``'s, or with
        ``everyone=True`` all people's)."""
        params = {"user": user, "all": "1" if everyone else None}
        return self.request_all("jobs", "jobs", params=params)

    def job(self, name: str, user: str | None = None) -> "Job":
        """A handle on the job ``name`` (no request is made until it is used)."""
        return Job(self, name, user=user)

    def submit(self, spec: Mapping | None = None, /, **fields) -> "Job":
        """Submit a job: a whole ``spec`` (the API's JSON) or `build_spec` keyword fields.

        ``submit(name=…, strategy="parameter-server", ps=1, workers=2, gpus=1, source=…)``, or
        ``submit({"name": …, "strategy": "parameter-server", "replicas": {"ps": 1,
        "worker": 2}, "source": …})``. A program of several files: ``source`` is the entry
        point, ``files`` the others (``files=["mnist_setup.py"]``, read from the current
        folder, or ``{"mnist_setup.py": text}``), placed beside it and importable by it.
        A parameter-server job always has one chief (the
        coordinator): a spec whose ``replicas`` name no ``chief`` gets ``"chief": 1``, as
        the ``gpulab jobs submit`` command and the keyword form do; a ``chief`` the spec
        names is sent as it is (`with_chief`). The ``spec`` given is not changed.
        Raises `GpulabError` with the service's message (and ``field``) when it is refused.
        """
        if spec is not None and fields:
            raise TypeError("submit() takes a spec or keyword fields, not both")
        body = with_chief(spec) if spec is not None else jobmodel.build_spec(**fields)
        view = self.request("POST", "jobs", body=body)
        return Job(self, view["name"], view=view)


class Job:
    """One job of a person, by name. ``view`` is its last known state (`status` refreshes)."""

    def __init__(self, client: Client, name: str, *, user: str | None = None,
                 view: dict | None = None):
        self.client, self.name, self.user, self.view = client, name, user, view

    def __repr__(self) -> str:
        state = self.view["state"] if self.view else "?"
        return f"<gpulab Job {self.name!r} {state}>"

    def _path(self, *parts: str) -> str:
        return "/".join(["jobs", quote(self.name, safe=""), *(quote(p, safe="") for p in parts)])

    def status(self) -> dict:
        """The job now: state, reason, replicas, gpus, started_at, finished_at, progress."""
        self.view = self.client.request("GET", self._path(), params={"user": self.user})
        return self.view

    @property
    def state(self) -> str:
        return self.status()["state"]

    def stop(self) -> dict:
        """Stop every replica and release the job's GPUs; the job's state afterwards."""
        self.view = self.client.request("POST", self._path("stop"), params={"user": self.user})
        return self.view

    def wait(self, timeout: float | None = None, interval: float = 2.0) -> dict:
        """Wait until the job has ended; its final state. `TimeoutError` after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            view = self.status()
            if view["state"] in FINAL_STATES:
                return view
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {self.name} is still {view['state']} after {timeout} s")
            pause = interval if deadline is None else min(interval, deadline - time.monotonic())
            time.sleep(max(0.0, pause))

    def read_log(self, replica: str, offset: int = 0, follow: bool = False,
                 raw: bool = False) -> dict:
        """One piece of a replica's log: ``{text, offset (where to ask next), from, size,
        done}``; ``text`` as a terminal shows it, from ``from`` (the start of the line still
        open at ``offset``: it replaces the reader's open line, `joblog.merge`), or with
        ``raw`` the bytes as written from ``offset``. With ``follow`` the service waits up to
        20 s for more while the job runs."""
        return self.client.request(
            "GET", self._path("logs", replica),
            params={"offset": offset, "follow": "1" if follow else None,
                    "raw": "1" if raw else None, "user": self.user},
            timeout=FOLLOW_TIMEOUT if follow else None)

    def logs(self, replica: str | None = None, follow: bool = False, offset: int = 0,
             raw: bool = False) -> str | Iterator[str]:
        """A replica's log (default: the chief, or worker 0) as a terminal shows it (``raw``:
        as written): the whole text so far, or with ``follow=True`` a generator of its
        finished lines as they come (and the last, unfinished one at the end) that ends when
        the job has ended (`follow_lines` also gives the line being redrawn meanwhile)."""
        replica = replica or lead_replica(self.view or self.status())
        if follow:
            return self._follow(replica, offset, raw)
        text = ""
        while True:
            piece = self.read_log(replica, offset, raw=raw)
            text = joblog.merge(text, piece["text"], piece.get("from", offset) < offset)
            if piece["offset"] >= piece["size"] or piece["offset"] <= offset:
                return text
            offset = piece["offset"]

    def follow_lines(self, replica: str | None = None, offset: int = 0,
                     raw: bool = False) -> Iterator[tuple[str, str]]:
        """Follow a replica's log until the job has ended: ``(finished, open)`` after each
        read: the lines finished since the last (text ending with ``\\n``, or ""), and the
        line still being written or redrawn, in its newest state (with ``raw``: the new
        bytes as written, and "")."""
        replica = replica or lead_replica(self.view or self.status())
        open_line = ""
        while True:
            piece = self.read_log(replica, offset, follow=True, raw=raw)
            rewound = piece.get("from", offset) < offset
            asked, offset = offset, piece["offset"]
            if raw:
                if piece["text"]:
                    yield piece["text"], ""
            else:
                text = joblog.merge(open_line, piece["text"], rewound)
                finished, now_open = joblog.finished_part(text)
                if finished or now_open != open_line:
                    open_line = now_open
                    yield finished, open_line
            if piece["done"] and offset <= asked:  # ended, and nothing more was written
                return

    def _follow(self, replica: str, offset: int, raw: bool = False) -> Iterator[str]:
        open_line = ""
        for finished, open_line in self.follow_lines(replica, offset, raw):
            if finished:
                yield finished
        if open_line:
            yield open_line

    def tensorboard_url(self, prefix: str | None = None) -> str:
        """Where TensorBoard shows this job's runs, in the person's own notebook server."""
        return jobmodel.tensorboard_url(self.name, prefix=prefix)


def _api_error(e: urllib.error.HTTPError, address: str | None = None,
               who: str = "The gpulab service") -> GpulabError:
    try:
        raw = e.read()
    except OSError:
        raw = b""
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("message"):
        return GpulabError(str(body["message"]), e.code, body.get("field"), address=address)
    if e.code == 503 or e.code == 502:
        return GpulabError(f"{who} is not available right now (HTTP {e.code}); "
                           "try again in a moment, or ask the hub's admin.", e.code,
                           kind="status", reason=str(e.reason), address=address)
    return GpulabError(f"{who} refused the request (HTTP {e.code} {e.reason}).",
                       e.code, kind="status", reason=str(e.reason), address=address)
