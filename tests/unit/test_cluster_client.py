"""The notebook side of a held cluster (issue 38, `gpulab.extensions.cluster`): the spec
``gpulab.cluster(...)`` sends is one the service accepts, in the job spec's words; its place
in line in words; ``import gpulab`` (``gpulab.cluster``) imports neither TensorFlow nor the
hub."""

import subprocess
import sys

from gpulab.extensions.cluster import cluster_spec, waiting_words
from gpulab.hub.jobs.spec import parse_spec


def test_the_spec_a_notebook_sends_is_a_cluster_the_service_accepts():
    spec = parse_spec(cluster_spec(name="c1", ps=2, workers=4, gpus_per_worker=1,
                                   memory="2Gi", max_runtime=3600))
    assert spec.is_cluster and spec.total_gpus == 4 and spec.max_runtime == 3600
    assert spec.replica_names() == [("ps", 0), ("ps", 1)] + [("worker", i) for i in range(4)]
    assert spec.resources["worker"].memory == "2Gi"
    assert parse_spec(cluster_spec(name="c2", gpus_per_ps=1)).gpus_of("ps") == 1


def test_its_place_in_line_in_words():
    view = {"name": "c1", "gpus": 4, "queue": {"position": 2, "ahead": 1, "ahead_gpus": 3,
                                               "estimated_start": None,
                                               "reason": "Waits for 4 GPUs"}}
    assert waiting_words(view) == ("Cluster c1 waits for 4 GPU(s): #2 in line, 1 request(s) "
                                   "with 3 GPU(s) ahead (Waits for 4 GPUs)")
    assert "held in the queue by an admin" in waiting_words(
        {"name": "c1", "gpus": 1, "queue": {"held": True, "reason": "maintenance"}})


def test_gpulab_cluster_is_light_to_import():
    code = ("import sys, gpulab\n"
            "assert callable(gpulab.cluster)\n"
            "import gpulab.extensions.cluster\n"
            "heavy = [m for m in ('tensorflow', 'gpulab.hub', 'tornado', 'ipywidgets')"
            " if m in sys.modules]\n"
            "print(heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
