"""TensorBoard served on a Unix socket: the server class, the fonts behind the proxy, and no
data server. Used by the server extension (`serverext`) and by the ``%tensorboard`` magic's
launcher (`tbmagic`); both import it, neither imports the other for it."""

from __future__ import annotations

import sys

_ABSOLUTE_FONTS = b"url(/font-roboto/"
_RELATIVE_FONTS = b"url(font-roboto/"
#: and its Polymer code adds a stylesheet from Google Fonts unless told not to: on a machine
#: without the internet it never loads (the Roboto above is the same font, served locally)
_NO_GOOGLE_FONTS = b"<script>window.polymerSkipLoadingFontRoboto = true;</script>"


def relative_fonts(index_html: bytes) -> bytes:
    """TensorBoard's index page with its fonts from where it is served, and no request for
    Google Fonts (`fonts_behind_proxy`)."""
    page = index_html.replace(_ABSOLUTE_FONTS, _RELATIVE_FONTS)
    if _NO_GOOGLE_FONTS not in page:  # before TensorBoard's code (the page has no <head>)
        at = page.find(b"<script")
        at = at if at >= 0 else len(page)
        page = page[:at] + _NO_GOOGLE_FONTS + page[at:]
    return page


def fonts_behind_proxy(app):
    """TensorBoard's WSGI application with its index page rewritten by `relative_fonts`: the
    page is served uncompressed (the rewrite needs its text; it is about 200 kB), every other
    response as TensorBoard makes it."""

    def wrapped(environ, start_response):
        if environ.get("PATH_INFO", "") not in ("", "/", "/index.html"):
            return app(environ, start_response)
        environ = {**environ, "HTTP_ACCEPT_ENCODING": "identity"}
        captured = {}

        def capture(status, headers, exc_info=None):
            captured["status"], captured["headers"] = status, headers
            return lambda data: None  # TensorBoard returns its body; it never writes

        result = app(environ, capture)
        try:
            body = b"".join(result)
        finally:
            if hasattr(result, "close"):
                result.close()
        headers = captured["headers"]
        if captured["status"].startswith("200") and any(
                k.lower() == "content-type" and v.startswith("text/html") for k, v in headers):
            body = relative_fonts(body)
            headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
            headers.append(("Content-Length", str(len(body))))
        start_response(captured["status"], headers)
        return [body]

    return wrapped


def unix_socket_server_class(path: str, key: int = 0):
    """A TensorBoard server class (``TensorBoard(server_class=...)``) serving TensorBoard's
    WSGI application on the Unix socket `path` instead of a TCP port. TensorBoard records a
    "port" for its notebook magic: `key` stands in for it (`socket_for_key`)."""
    from tensorboard import program
    from werkzeug import serving

    class UnixSocketServer(serving.ThreadedWSGIServer, program.TensorBoardServer):
        daemon_threads = True

        def __init__(self, wsgi_app, flags):
            serving.ThreadedWSGIServer.__init__(self, "unix://" + path, 0,
                                                fonts_behind_proxy(wsgi_app))

        def get_url(self):
            return f"http://localhost:{key}/"

        def print_serving_message(self):
            print(f"TensorBoard {program.version.VERSION} at unix://{path}", file=sys.stderr,
                  flush=True)

    return UnixSocketServer


def without_data_server(tb) -> None:
    """Keep a configured ``program.TensorBoard`` from starting its fast data server.

    With ``--load_fast`` (``auto`` by default) TensorBoard reads the logs through a subprocess,
    rustboard, that serves them over gRPC on a loopback TCP port, without authentication and
    with no Unix-socket option: every local account could read the person's runs through it.
    TensorBoard's own Python loader (``--load_fast=false``) stays inside the process. Set on
    the parsed flags, so that the cache key the ``%tensorboard`` magic matches is unchanged."""
    if getattr(tb.flags, "load_fast", "false") != "false":
        tb.flags.load_fast = "false"
