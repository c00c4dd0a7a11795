"""TensorBoard inside a person's notebook server, behind the hub: it reads their training runs
from shared storage, only they reach it, and TensorBoard's own magic is pointed at the proxy."""

import os
import time

import pytest
import requests

pytestmark = pytest.mark.app


def write_run(folder, tag="loss", values=(1.0, 0.5, 0.25)):
    """A run as training writes it (an event file of scalars), without TensorFlow."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    folder.mkdir(parents=True, exist_ok=True)
    writer = EventFileWriter(str(folder))
    for step, value in enumerate(values):
        writer.add_event(Event(step=step, wall_time=time.time(), summary=Summary(
            value=[Summary.Value(tag=tag, simple_value=value)])))
    writer.close()


def chown_like(path, ref):
    st = os.stat(ref)
    for root, dirs, files in os.walk(path):
        for name in [root, *(os.path.join(root, f) for f in files)]:
            os.chown(name, st.st_uid, st.st_gid)


def test_tensorboard_serves_my_runs_to_me_only(hub, users):
    ann, bob = users["ann"], users["bob"]
    ann.start_server("", {"profile": "cpu"})
    try:
        mine = hub.data_dir / "shared" / "users" / "ann"
        write_run(mine / "jobs" / "demo" / "tensorboard" / "train")
        chown_like(mine / "jobs", mine)

        # TensorBoard's own %tensorboard magic is pointed at the server's proxy
        out = ann.run_in_kernel("import os; print(os.environ.get('TENSORBOARD_PROXY_URL'))")
        assert out.strip() == "/user/ann/gpulab-tensorboard/%PORT%/"

        base = f"{hub.user_url('ann')}tensorboard/"
        headers = {"Authorization": f"token {ann.token()}"}
        r = requests.get(base, headers=headers, timeout=120)  # starts it on first use
        assert r.status_code == 200 and "TensorBoard" in r.text, r.text[:300]
        deadline = time.time() + 60
        while time.time() < deadline:
            runs = requests.get(base + "data/runs", headers=headers, timeout=30).json()
            if "demo/tensorboard/train" in runs:
                break
            time.sleep(1)
        assert "demo/tensorboard/train" in runs, runs
        scalars = requests.get(base + "data/plugin/scalars/scalars",
                               params={"run": "demo/tensorboard/train", "tag": "loss"},
                               headers=headers, timeout=30).json()
        assert [round(point[2], 2) for point in scalars] == [1.0, 0.5, 0.25]

        # another person, with their own valid token, is refused
        r = requests.get(base, headers={"Authorization": f"token {bob.token()}"},
                         allow_redirects=False, timeout=30)
        assert r.status_code == 403, (r.status_code, r.text[:200])
        r = requests.get(base + "data/runs", allow_redirects=False, timeout=30)
        assert r.status_code in (302, 401, 403)
    finally:
        ann.stop_server("")
