"""Issue 12 item 3: whoever binds a port the hub, the proxy or the gpulab service use gets no
token, because internal traffic is mutual TLS (JupyterHub's ``internal_ssl``).

Eve's strongest tool is her own server's certificate and key (signed by the hub's notebooks
CA, readable by her account). She listens with it where vic's notebook client expects the
gpulab service (as if she had bound the service's port after it died): the client refuses the
certificate during the handshake and never sends vic's token.
"""

import json
import time

import pytest

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

    # vic's kernel, told that the service is at eve's port, refuses it and sends nothing
    code = (
        "import json\n"
        "from gpulab.extensions.client import Client, GpulabError\n"
        f"gl = Client(url='https://127.0.0.1:{port}/services/gpulab/')\n"
        "try:\n    gl.me(); print(json.dumps('ANSWERED'))\n"
        "except GpulabError as e:\n    print(json.dumps(e.message))\n"
        "print(json.dumps(Client().me()['user']))\n")
    lines = vic.run_in_kernel(code, timeout=90).strip().splitlines()
    refused, me = json.loads(lines[-2]), json.loads(lines[-1])
    assert "CERTIFICATE_VERIFY_FAILED" in refused, refused
    assert me == "vic"  # the real service still answers vic

    deadline = time.time() + 30
    captured = ""
    while time.time() < deadline:
        captured = eve.sh(f"cat {out} 2>/dev/null").stdout
        if captured:
            break
        time.sleep(0.5)
    assert "HANDSHAKE-OK" not in captured and vic.token() not in captured, captured
