"""Fixtures of the cluster tier: one real control plane for the whole tier.

The binaries are built on first use by ``build.sh`` (a cold build takes a long while; later runs,
from any clone, copy them from the cache outside the checkout keyed by the module files, or reuse
Go's build cache), so the plain test command runs this tier too. Without a Go toolchain and without
built or cached binaries the fixture fails with build.sh's message: it does not skip.
"""

import subprocess
import uuid

import pytest

from .controlplane import BIN_DIR, BINARIES, BUILD_SCRIPT, HERE, ControlPlane, ControlPlaneError


def pytest_configure(config):
    config.addinivalue_line("markers", "cluster: a real Kubernetes control plane")
    config.addinivalue_line("markers", "node: pods run for real on a node of the cluster tier (node.py)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.cluster)


def _build(config) -> None:
    """Run build.sh: it copies cached binaries or builds missing ones (quiet when up to date)."""
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
