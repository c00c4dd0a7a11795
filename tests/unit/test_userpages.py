"""What the hub refuses as sent by a page of a person's server where all share one origin
(`gpulab.hub.deploy.userpages.from_user_pages`), and `gpulab up --subdomain-host`'s checks."""

import argparse

import pytest

from gpulab.hub.cli.up import (add_up_arguments, check_up_args, chosen_subdomain_host,
                               subdomain_host_url)
from gpulab.hub.deploy.userpages import from_user_pages

HOST = "127.0.0.1:8000"
PAGE = "http://127.0.0.1:8000/user/eve/proxy/9000/plot.html"
NAV = {"Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"}
FETCH = {"Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "cors", "Sec-Fetch-Dest": "empty"}


@pytest.mark.parametrize("method,headers,refused", [
    # from a page of a server: every change, every read that is not a top-level navigation
    ("PATCH", {**FETCH, "Referer": PAGE}, True),
    ("POST", {**NAV, "Referer": PAGE}, True),
    ("GET", {**FETCH, "Referer": PAGE}, True),
    ("GET", {**NAV, "Sec-Fetch-Dest": "iframe", "Referer": PAGE}, True),
    ("GET", {**NAV, "Referer": PAGE}, False),  # the lab's "Hub Control Panel" link
    ("GET", {"Referer": PAGE}, False),  # a browser without Sec-Fetch-*: a navigation
    # a change from this origin that hides where it came from
    ("POST", {**FETCH}, True),
    ("DELETE", {"Origin": "null"}, True),
    ("GET", {**FETCH}, False),
    # the hub's own pages, other hosts' pages (JupyterHub's XSRF check's job), API clients
    ("POST", {**FETCH, "Referer": "http://127.0.0.1:8000/hub/admin"}, False),
    ("POST", {**FETCH, "Referer": "http://127.0.0.1:8000/services/gpulab/admin"}, False),
    ("POST", {"Sec-Fetch-Site": "cross-site", "Referer": "http://other:1/user/x/"}, False),
    ("POST", {"Sec-Fetch-Site": "cross-site"}, False),
    ("PATCH", {"Authorization": "token x"}, False),
], ids=["patch", "form-post", "fetch-get", "iframe", "navigation", "old-browser-navigation",
        "post-no-referer", "origin-null", "get-no-referer", "hub-page", "service-page",
        "other-site", "cross-site-no-referer", "api-client"])
def test_refused_when_sent_by_a_server_page(method, headers, refused):
    assert bool(from_user_pages(method, headers, HOST, "/user/")) is refused


def test_a_prefixed_hub_checks_its_own_user_prefix():
    page = "http://h:1/jh/user/eve/x.html"
    assert from_user_pages("POST", {**FETCH, "Referer": page}, "h:1", "/jh/user/")
    assert not from_user_pages("POST", {**FETCH, "Referer": "http://h:1/jh/hub/x"}, "h:1", "/jh/user/")


def _args(*words):
    p = argparse.ArgumentParser()
    add_up_arguments(p)
    return p.parse_args(list(words))


@pytest.mark.parametrize("value,port,url", [
    ("localhost", 8000, "http://localhost:8000"),
    ("lab.example.org", 80, "http://lab.example.org"),
    ("https://lab.example.org/", 8000, "https://lab.example.org"),
    ("http://localhost:8123", 8000, "http://localhost:8123"),
    ("", 8000, ""),
])
def test_subdomain_host_url(value, port, url):
    assert subdomain_host_url(value, port) == url


@pytest.mark.parametrize("value,problem", [
    ("http://localhost:8000", None),
    ("lab.example.org", None),
    ("http://127.0.0.1:8000", "an address has no subdomains"),
    ("10.0.0.5", "an address has no subdomains"),
    ("http://localhost:8000/jupyter", "must have no path"),
    ("ftp://localhost", "must be http(s)"),
    ("http://localhost:99999", "is not a URL"),
])
def test_subdomain_host_is_checked(value, problem):
    found = check_up_args(_args("--subdomain-host", value))
    assert (found is None) if problem is None else (problem in found), found


@pytest.mark.parametrize("words,host", [
    # on loopback each server gets a host of its own by default: browsers resolve *.localhost
    ([], "http://localhost:8000"),
    (["--port", "8123"], "http://localhost:8123"),
    (["--ip", "::1"], "http://localhost:8000"),
    (["--ip", "localhost"], "http://localhost:8000"),
    # on the network no name is known to have subdomains: one origin, the guard and a warning
    (["--ip", "0.0.0.0"], ""),
    (["--ip", "192.168.1.5"], ""),
    # a loopback address that localhost does not lead to
    (["--ip", "127.0.0.5"], ""),
    # the operator's choice, either way
    (["--ip", "0.0.0.0", "--subdomain-host", "lab.example.org"], "http://lab.example.org:8000"),
    (["--subdomain-host", "https://lab.example.org"], "https://lab.example.org"),
    (["--no-subdomains"], ""),
], ids=["default", "port", "ipv6-loopback", "localhost", "any-address", "lan-address",
        "other-loopback", "wildcard-name", "https-name", "opted-out"])
def test_subdomains_are_the_default_on_loopback(words, host):
    args = _args(*words)
    assert check_up_args(args) is None
    assert chosen_subdomain_host(args) == host


def test_subdomain_host_and_no_subdomains_contradict():
    found = check_up_args(_args("--no-subdomains", "--subdomain-host", "lab.example.org"))
    assert found and "contradict" in found


def test_a_browser_on_another_name_of_the_hub_is_sent_to_its_own():
    """With subdomains the hub's cookies are for ``localhost``: a browser that opens the hub as
    ``http://127.0.0.1:<port>`` (the address gpulab up listens on) is sent to
    ``http://localhost:<port>`` with the same path and query; API clients (a token, no page
    load) and the hub's own names are answered where they asked."""
    import asyncio
    import socket

    from tornado import httpclient, httpserver, web

    from gpulab.hub.deploy.userpages import BrowsersToTheHubsHost

    class Login(web.RequestHandler):
        def get(self):
            self.finish("the login page")

    app = BrowsersToTheHubsHost([(r"/hub/login", Login)])
    app.base, app.domain = "http://localhost:8000", "localhost"
    nav = {"Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"}

    async def ask():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = httpserver.HTTPServer(app)
        server.listen(port, "127.0.0.1")
        out = []
        try:
            for host, headers in [("127.0.0.1:8000", nav),
                                  ("127.0.0.1:8000", {**nav, "Authorization": "token x"}),
                                  ("127.0.0.1:8000", {}),
                                  ("localhost:8000", nav),
                                  ("ann.localhost:8000", nav)]:
                r = await httpclient.AsyncHTTPClient().fetch(
                    f"http://127.0.0.1:{port}/hub/login?next=%2Fhub%2Fhome",
                    headers={"Host": host, **headers}, follow_redirects=False,
                    raise_error=False)
                out.append((r.code, r.headers.get("Location")))
        finally:
            server.stop()
        return out

    assert asyncio.run(ask()) == [
        (302, "http://localhost:8000/hub/login?next=%2Fhub%2Fhome"),
        (200, None), (200, None), (200, None), (200, None)]
