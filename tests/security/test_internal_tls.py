"""Issue 12 item 3: whoever binds a port the hub, the proxy or the gpulab service use gets no
token, because internal traffic is mutual TLS (JupyterHub's ``internal_ssl``).

Eve's strongest tool is her own server's certificate and key (signed by the hub's notebooks
CA, readable by her account). She listens with it where vic's notebook client expects the
gpulab service (as if she had bound the service's port after it died): the client refuses the
certificate during the handshake and never sends vic's token.
"""

import ipaddress
import json
import shlex
import socket
import ssl
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
from cryptography import x509

pytestmark = pytest.mark.security

FAKE_SERVICE = r'''
import glob, os, socket, ssl, sys, threading
certs = glob.glob("{certs}/eve.default/*")
key = [c for c in certs if c.endswith(".key")][0]
crt = [c for c in certs if c.endswith(".crt") and "ca_trust" not in c and "trust" not in os.path.basename(c)][0]
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(crt, key)
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(5)
print(srv.getsockname()[1], flush=True)
got = open("{out}", "ab")
srv.settimeout(60)
while True:
    try:
        conn, _ = srv.accept()
    except socket.timeout:
        break
    try:
        with ctx.wrap_socket(conn, server_side=True) as tls:
            tls.settimeout(5)
            got.write(b"HANDSHAKE-OK\n" + tls.recv(65536)); got.flush()
    except Exception as e:
        got.write(("FAILED " + type(e).__name__ + "\n").encode()); got.flush()
'''


def test_notebook_client_sends_no_token_to_a_fake_service(hub, vic, eve):
    certs = hub.data_dir / "server-certs"
    assert (certs / "eve.default").is_dir(), "eve's server has no certificates"
    out = f"{eve.account.pw_dir}/captured"
    r = eve.sh(f"cat > {eve.account.pw_dir}/fake.py <<'PY'\n"
               + FAKE_SERVICE.format(certs=certs, out=out) + "PY\n"
               f"(python3 {eve.account.pw_dir}/fake.py > {eve.account.pw_dir}/port 2>&1 < /dev/null &) ; "
               f"for i in $(seq 100); do [ -s {eve.account.pw_dir}/port ] && break; sleep 0.2; done; "
               f"cat {eve.account.pw_dir}/port")
    port = int(r.stdout.split()[0])

    # vic's notebook client, with her server's TLS files, told that the service is at eve's
    # port, refuses it and sends nothing. (It runs as vic's account in the machine's network:
    # her server itself runs in her own network namespace, issue 33 item 2, where no port of
    # eve's exists at all; the relay from it to the service's port would reach eve's listener
    # if she had bound that port, which is what this stands for.)
    tls_env = json.loads(vic.run_in_kernel(
        "import json, os\n"
        "print(json.dumps({k: os.environ[k] for k in ('JUPYTERHUB_SSL_CLIENT_CA',"
        " 'JUPYTERHUB_SSL_CERTFILE', 'JUPYTERHUB_SSL_KEYFILE', 'GPULAB_SERVICE_URL')}))\n"))
    code = (
        "import json\n"
        "from gpulab.extensions.client import Client, GpulabError\n"
        f"gl = Client(url='https://127.0.0.1:{port}/services/gpulab/')\n"
        "try:\n    gl.me(); print(json.dumps('ANSWERED'))\n"
        "except GpulabError as e:\n    print(json.dumps(e.message))\n")
    r = vic.sh(f"{sys.executable} -c {shlex.quote(code)}", env=tls_env, timeout=90, check=True)
    refused = json.loads(r.stdout.strip().splitlines()[-1])
    assert "CERTIFICATE_VERIFY_FAILED" in refused, refused
    # the real service still answers vic's server
    me = vic.run_in_kernel("import json\nfrom gpulab.extensions.client import Client\n"
                           "print(json.dumps(Client().me()['user']))\n", timeout=90)
    assert json.loads(me) == "vic"

    deadline = time.time() + 30
    captured = ""
    while time.time() < deadline:
        captured = eve.sh(f"cat {out} 2>/dev/null").stdout
        if captured:
            break
        time.sleep(0.5)
    assert "HANDSHAKE-OK" not in captured and vic.token() not in captured, captured


LISTEN_AS_EVE = r"""
import glob, os, socket, ssl
certs = glob.glob("{certs}/eve.default/*")
key = [c for c in certs if c.endswith(".key")][0]
crt = [c for c in certs if c.endswith(".crt") and "trust" not in os.path.basename(c)][0]
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(crt, key)
socks = []
for ip in {ips!r}:
    s = socket.socket(); s.bind((ip, 0)); s.listen(5); s.settimeout(0.2); socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks), flush=True)
got = open("{out}", "ab")
import time
end = time.time() + 60
while time.time() < end:
    for s in socks:
        try:
            conn, _ = s.accept()
        except socket.timeout:
            continue
        try:
            with ctx.wrap_socket(conn, server_side=True) as tls:
                tls.settimeout(5)
                got.write(("HANDSHAKE-OK " + tls.getsockname()[0] + "\n").encode()
                          + tls.recv(65536) + b"\n"); got.flush()
        except Exception as e:
            got.write(("FAILED " + type(e).__name__ + "\n").encode()); got.flush()
"""


#: what the proxy would forward to vic's server: vic's cookie
VIC_REQUEST = (b"GET /user/vic/api/contents HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               b"Cookie: jupyterhub-user-vic=SECRET-OF-VIC\r\n\r\n")


def _routes(admin) -> dict[str, tuple[str, int]]:
    r = admin.api("GET", "/proxy")
    assert r.status_code == 200, r.text
    out = {}
    for spec, route in r.json().items():
        u = urlparse(route["target"])
        # with subdomains a route is <host>/<path> (vic.localhost/user/vic/): keyed by its path
        path = spec if spec.startswith("/") else "/" + spec.split("/", 1)[1]
        out[path] = (u.hostname, u.port)
    return out


def _cert_ips(folder: Path, host: str = "") -> list[str]:
    """The addresses a server's certificate names; the only host name it may name is its
    person's own (`host`, ``<name>.localhost`` with subdomains, which the proxy checks)."""
    crt = [c for c in folder.glob("*.crt") if "trust" not in c.name]
    assert len(crt) == 1, crt
    cert = x509.load_pem_x509_certificate(crt[0].read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ([host] if host else []), \
        "a server certificate names a host name not its person's"
    return [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]


def _own_host(hub, name: str) -> str:
    """The host name of `name`'s servers (with subdomains), else ''."""
    from urllib.parse import urlsplit

    return urlsplit(hub.user_url(name)).hostname if hub.subdomains else ""


def _handshake_as_proxy(hub, ip: str, port: int, payload: bytes = b"") -> str:
    """Connect to ip:port as the proxy connects to servers: the proxy's CA bundle (hub-ca
    and notebooks-ca), hostname checking, the proxy's client certificate; `payload` is sent
    once the handshake succeeded. 'OK' or the error."""
    tls = hub.data_dir / "tls" / "internal-ssl"
    ctx = ssl.create_default_context(cafile=str(tls / "proxy-client-ca_trust.crt"))
    assert ctx.check_hostname and ctx.verify_mode == ssl.CERT_REQUIRED
    client = tls / "proxy-client"
    ctx.load_cert_chain(str(client / "proxy-client.crt"), str(client / "proxy-client.key"))
    try:
        with socket.create_connection((ip, port), timeout=10) as raw:
            with ctx.wrap_socket(raw, server_hostname=ip) as conn:
                if payload:
                    conn.sendall(payload)
        return "OK"
    except ssl.SSLCertVerificationError as e:
        return f"REFUSED {e.verify_message}"


def test_no_server_certificate_is_valid_for_another_servers_address(hub, admin, vic, eve):
    """Each server listens on a loopback address of its own, which alone its certificate
    names: eve, listening on vic's address with her own server's certificate (as she could
    after vic's server died while its proxy route remained), is refused by a client that
    verifies as the proxy does, and so never receives vic's proxied requests."""
    routes = _routes(admin)
    vic_ip, vic_port = routes["/user/vic/"]
    eve_ip, _ = routes["/user/eve/"]
    assert vic_ip != eve_ip, routes
    for ip in (vic_ip, eve_ip):
        addr = ipaddress.ip_address(ip)
        assert addr in ipaddress.ip_network("127.0.0.0/8"), ip
        assert addr not in ipaddress.ip_network("127.0.0.0/24"), ip  # the hub's own services
    certs = hub.data_dir / "server-certs"
    assert _cert_ips(certs / "vic.default", _own_host(hub, "vic")) == [vic_ip]
    assert _cert_ips(certs / "eve.default", _own_host(hub, "eve")) == [eve_ip]

    home = eve.account.pw_dir
    out = f"{home}/captured-server"
    r = eve.sh(f"cat > {home}/listen.py <<'PY'\n"
               + LISTEN_AS_EVE.format(certs=certs, ips=[vic_ip, eve_ip], out=out) + "PY\n"
               f"(python3 {home}/listen.py > {home}/ports 2>&1 < /dev/null &) ; "
               f"for i in $(seq 100); do [ -s {home}/ports ] && break; sleep 0.2; done; "
               f"cat {home}/ports")
    ports = r.stdout.split()
    assert len(ports) == 2 and all(p.isdigit() for p in ports), (r.stdout, r.stderr)
    on_vic, on_eve = int(ports[0]), int(ports[1])

    # on her own address eve's certificate is valid (the client and the listener work) ...
    assert _handshake_as_proxy(hub, eve_ip, on_eve, b"CONTROL") == "OK"
    # ... on vic's it is not: the proxy would send her none of vic's requests
    refused = _handshake_as_proxy(hub, vic_ip, on_vic, VIC_REQUEST)
    assert refused.startswith("REFUSED") and "mismatch" in refused.lower(), refused

    deadline, captured = time.time() + 20, ""
    while time.time() < deadline:
        captured = eve.sh(f"cat {out} 2>/dev/null").stdout
        if captured.count("\n") >= 2:
            break
        time.sleep(0.3)
    assert f"HANDSHAKE-OK {eve_ip}" in captured, captured
    assert f"HANDSHAKE-OK {vic_ip}" not in captured, captured
    assert "SECRET-OF-VIC" not in captured, captured

    # vic's own server still verifies on its address, and still answers through the proxy
    assert _handshake_as_proxy(hub, vic_ip, vic_port) == "OK"
    assert vic.wait_ready(timeout=10)
    assert routes["/user/vic/"] == _routes(admin)["/user/vic/"]
