"""Fixtures of the cluster tier: one real control plane for the whole tier.

The binaries are built on first use by ``build.sh`` (a cold build takes a long while; later runs,
from any clone, copy them from the cache outside the checkout keyed by the module files, or reuse
Go's build cache), so the plain test command runs this tier too. Without a Go toolchain and without
built or cached binaries the fixture fails with build.sh's message: it does not skip.
"""

import os
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from .controlplane import BIN_DIR, BINARIES, BUILD_SCRIPT, HERE, ControlPlane, ControlPlaneError


def pytest_configure(config):
    config.addinivalue_line("markers", "cluster: a real Kubernetes control plane")
    config.addinivalue_line("markers", "node: pods run for real on a node of the cluster tier (node.py)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.cluster)
    # This tier runs last, and its binaries are built (or copied from the cache) in the
    # background from the start of the session: on a new machine the Go build (tens of
    # minutes on two cores) overlaps the other tiers, which mostly wait on hubs and browsers.
    ours = [i for i in items if HERE in i.path.parents]
    if ours and len(ours) < len(items):
        items[:] = [i for i in items if HERE not in i.path.parents] + ours
    if ours and not config.getoption("collectonly") and _background_build is None:
        _start_background_build(config)


#: the build.sh started at collection (see above), and where its output goes
_background_build: subprocess.Popen | None = None


def _start_background_build(config) -> None:
    global _background_build
    # pytest's cache folder (absent under ``-p no:cacheprovider``: a folder of its own then)
    cache = getattr(config, "cache", None)
    folder = cache.mkdir("cluster-build") if cache is not None else Path(
        tempfile.mkdtemp(prefix="gpulab-cluster-build-"))
    log = open(folder / "build.log", "w")
    # at the lowest priority: the tests that run meanwhile keep the CPU they need
    _background_build = subprocess.Popen(
        ["nice", "-n", "19", "bash", str(BUILD_SCRIPT), "--quiet"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True)
    log.close()


def pytest_unconfigure(config):
    if _background_build is not None and _background_build.poll() is None:
        os.killpg(_background_build.pid, 15)  # the session ended before the tier needed it
        _background_build.wait()


def _build(config) -> None:
    """Run build.sh: it copies cached binaries or builds missing ones (quiet when up to date).

    Waits first for the build started in the background at collection: what it built, this
    run finds up to date; a failure of it is this run's to report."""
    if _background_build is not None and _background_build.poll() is None:
        print("waiting for the cluster tier's build (started in the background) ...")
        _background_build.wait()
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():  # show a build's progress as it happens
        r = subprocess.run(["bash", str(BUILD_SCRIPT), "--quiet"], check=False,
                           stderr=subprocess.PIPE, text=True)
    if r.returncode == 0:
        return
    why = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"
    if r.returncode == 127:  # no Go toolchain, and no built or cached binaries
        pytest.fail(f"the cluster tests need {', '.join(BINARIES)} in {BIN_DIR}: {why}", pytrace=False)
    pytest.fail(f"{BUILD_SCRIPT} failed: {why}\n{r.stderr[-3000:]}", pytrace=False)


@pytest.fixture(scope="package")
def control_plane(request):
    """A started ``ControlPlane`` (see controlplane.py for its nodes, taint and helpers).

    Package-scoped: started once for this tier and stopped after its last test, so that it
    does not run (and take CPU) while the other tiers of the same session run.
    """
    _build(request.config)
    cp = ControlPlane()
    try:
        cp.start()
    except ControlPlaneError as e:
        # the free ports are picked before the components bind them: another process may
        # have taken one in between; that deserves one more try, nothing else does
        if "address already in use" not in str(e):
            raise
        cp = ControlPlane()
        cp.start()
    print(f"control plane up in {cp.startup_seconds:.1f}s at {cp.server} ({cp.dir})")
    yield cp
    cp.stop()


@pytest.fixture
def namespace(control_plane):
    """A fresh namespace with its default ServiceAccount; deleted (without waiting) afterwards."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    control_plane.create_namespace(name)
    yield name
    control_plane.api("DELETE", f"/api/v1/namespaces/{name}")
