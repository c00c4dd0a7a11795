"""The job drivers' boundary: the workflow (`gpulab.hub.jobs.base.JobBackend`) is written once
and the drivers fill its hooks, as oauthenticator's base keeps ``authenticate`` and its
subclasses fill ``token_to_user``: no driver overrides a workflow method, each workflow
method says so, and the Kueue driver's admission choice is the named hook ``_admission``."""

from __future__ import annotations

import inspect

import pytest

from gpulab.hub.jobs.base import JobBackend
from gpulab.hub.jobs.kube import KubeJobBackend
from gpulab.hub.jobs.kueue import KueueJobBackend
from gpulab.hub.jobs.local import LocalJobBackend

DRIVERS = [LocalJobBackend, KubeJobBackend, KueueJobBackend]


def test_the_workflow_is_the_bases_and_says_so():
    assert JobBackend.WORKFLOW and len(set(JobBackend.WORKFLOW)) == len(JobBackend.WORKFLOW)
    for name in JobBackend.WORKFLOW:
        method = vars(JobBackend)[name]  # defined by the base itself
        assert "Drivers should not override this method" in (inspect.getdoc(method) or ""), name


@pytest.mark.parametrize("driver", DRIVERS, ids=lambda c: c.__name__)
def test_no_driver_overrides_the_workflow(driver):
    mine = [name for name in JobBackend.WORKFLOW
            for cls in driver.__mro__[:driver.__mro__.index(JobBackend)]
            if name in vars(cls)]
    assert mine == [], f"{driver.__name__} overrides the workflow's {mine}: fill a hook instead"


def test_the_kueue_drivers_admission_choice_is_a_named_hook():
    assert "_admission" not in JobBackend.WORKFLOW
    assert "_admission" in vars(KueueJobBackend)
    assert "_admission" not in vars(LocalJobBackend) and "_admission" not in vars(KubeJobBackend)


def test_kueue_uses_what_kube_publishes():
    """`gpulab.hub.jobs.kueue` imports no private name of `gpulab.hub.jobs.kube`."""
    import ast

    import gpulab.hub.jobs.kueue as kueue

    tree = ast.parse(inspect.getsource(kueue))
    private = [a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and node.module == "gpulab.hub.jobs.kube" for a in node.names
               if a.name.startswith("_")]
    assert private == []
