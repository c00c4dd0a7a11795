"""Container images of the cluster tier's real node, made here: no registry can be reached.

- ``gpulab.test/pause:1``: the pod sandbox, ``image/pause.c`` built with ``gcc -static``.
- ``gpulab.test/singleuser:<key>``: what ``images/singleuser`` makes for a cluster, from parts this
  machine has: a Debian bookworm root filesystem (``debootstrap --variant=minbase``, with
  Debian's Python 3.11, the interpreter of the README's environment) and that environment itself
  (``$GPULAB_HOME/venv``: gpulab, JupyterLab, TensorFlow on the CPU) copied in at the same path.
  The real image starts from a CUDA base that cannot be pulled here; everything gpulab and the
  notebook run is the same.

Each image is an OCI image archive (uncompressed layers: they are only ever imported locally),
kept in ``$GPULAB_CLUSTER_BIN_CACHE/images`` under a key of what it is made of, and imported into
the node's containerd with ``ctr images import``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PAUSE_SOURCE = HERE / "image" / "pause.c"
PAUSE_IMAGE = "gpulab.test/pause:1"
SINGLEUSER_REPO = "gpulab.test/singleuser"
DEBIAN_SUITE = "bookworm"
# what the notebook image needs of Debian besides minbase: the venv's interpreter, and tini
# to reap a kernel's children as PID 1 the way the real image's entrypoint does
DEBIAN_PACKAGES = ("python3.11", "libpython3.11", "ca-certificates", "tini")
NOTEBOOK_UID = 1000
NOTEBOOK_GID = 100  # users, as images/singleuser/Dockerfile and z2jh's fsGid


def cache_root() -> Path:
    base = os.environ.get("GPULAB_CLUSTER_BIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gpulab", "cluster-bin")
    return Path(base) / "images"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_oci_archive(out: Path, name: str, layers: list[Path], config: dict[str, Any]) -> None:
    """An OCI image archive at ``out`` naming the image ``name`` (the index's
    ``io.containerd.image.name``), from uncompressed layer tars, bottom first. The layer files
    are moved into the archive's blobs (written next to ``out``)."""
    work = Path(tempfile.mkdtemp(prefix=".oci-", dir=out.parent))
    try:
        blobs = work / "blobs" / "sha256"
        blobs.mkdir(parents=True)
        layer_descs, diff_ids = [], []
        for layer in layers:
            digest = _sha256_file(layer)
            size = layer.stat().st_size
            shutil.move(str(layer), blobs / digest)
            layer_descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar",
                                "digest": f"sha256:{digest}", "size": size})
            diff_ids.append(f"sha256:{digest}")

        def blob(obj: dict[str, Any], media_type: str) -> dict[str, Any]:
            data = json.dumps(obj, sort_keys=True).encode()
            digest = hashlib.sha256(data).hexdigest()
            (blobs / digest).write_bytes(data)
            return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}

        image_config = {"architecture": "amd64", "os": "linux", "config": config,
                        "rootfs": {"type": "layers", "diff_ids": diff_ids}}
        config_desc = blob(image_config, "application/vnd.oci.image.config.v1+json")
        manifest_desc = blob({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                              "config": config_desc, "layers": layer_descs},
                             "application/vnd.oci.image.manifest.v1+json")
        manifest_desc["annotations"] = {"io.containerd.image.name": name,
                                        "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1]}
        (work / "index.json").write_text(json.dumps(
            {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [manifest_desc]}))
        (work / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
        tmp = out.with_name(out.name + ".tmp")
        subprocess.run(["tar", "-C", str(work), "-cf", str(tmp), "oci-layout", "index.json", "blobs"],
                       check=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _tar_dir(src: Path, out: Path, *, prefix: str = ".", extra: list[str] | None = None) -> None:
    """A layer tar of the folder ``src`` (owners kept as numbers), under ``prefix``."""
    subprocess.run(["tar", "--numeric-owner", "--xattrs", "-C", str(src), "-cf", str(out),
                    *(extra or []), prefix], check=True)


def pause_archive() -> Path:
    """The pause image's archive, built when missing (a second)."""
    source = PAUSE_SOURCE.read_bytes()
    key = hashlib.sha256(source).hexdigest()[:16]
    out = cache_root() / f"pause-{key}.tar"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as d:
        root = Path(d) / "root"
        root.mkdir()
        subprocess.run(["gcc", "-static", "-O2", "-o", str(root / "pause"), str(PAUSE_SOURCE)], check=True)
        layer = Path(d) / "layer.tar"
        with tarfile.open(layer, "w") as tar:
            info = tar.gettarinfo(str(root / "pause"), arcname="pause")
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with open(root / "pause", "rb") as f:
                tar.addfile(info, f)
        write_oci_archive(out, PAUSE_IMAGE, [layer],
                          {"Entrypoint": ["/pause"], "User": "65535:65535"})
    return out


def debian_rootfs() -> Path:
    """A Debian bookworm root filesystem with ``DEBIAN_PACKAGES`` (``debootstrap --variant=minbase``,
    a few minutes the first time), kept in the cache under a key of the suite and packages."""
    key = hashlib.sha256(f"{DEBIAN_SUITE} {' '.join(DEBIAN_PACKAGES)} 1".encode()).hexdigest()[:16]
    root = cache_root() / f"rootfs-{key}"
    if (root / ".complete").exists():
        return root
    if not shutil.which("debootstrap"):
        raise RuntimeError("the cluster tier's test image needs debootstrap (apt-get install debootstrap)")
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    mirror = os.environ.get("GPULAB_DEBIAN_MIRROR", "http://deb.debian.org/debian")
    r = subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(DEBIAN_PACKAGES)}",
                        DEBIAN_SUITE, str(tmp), mirror], capture_output=True, text=True)
    if r.returncode != 0:
        log = (tmp / "debootstrap" / "debootstrap.log")
        detail = log.read_text()[-2000:] if log.exists() else r.stderr[-2000:]
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"debootstrap failed ({r.returncode}): {detail}")
    # what an image does not need: package caches and the documentation
    for d in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man"):
        shutil.rmtree(tmp / d, ignore_errors=True)
    (tmp / ".complete").write_text("")
    tmp.rename(root)
    return root


def singleuser_archive(venv: Path) -> tuple[str, Path]:
    """(image name, OCI archive) of the test notebook image: ``debian_rootfs()`` plus ``venv``
    (the README's environment: gpulab, JupyterLab, TensorFlow) at the same path, a ``jovyan``
    account (uid ``NOTEBOOK_UID``, group users) whose home is where KubeGPUSpawner mounts it, and
    ``jupyterhub-singleuser`` as the command, as ``images/singleuser/Dockerfile`` does."""
    venv = venv.resolve()
    stamp = (venv / ".gpulab-installed")
    # setup.sh's stamp says what was installed; a developer's reinstall of gpulab alone
    # (pip install --no-deps .) shows in its files' times
    package = sorted(venv.glob("lib/python3*/site-packages/gpulab"))
    newest = max((f.stat().st_mtime_ns for d in package for f in d.rglob("*.py")), default=0)
    made_of = f"{stamp.read_text() if stamp.exists() else venv.stat().st_mtime} {newest} {venv} 1"
    rootfs = debian_rootfs()
    key = hashlib.sha256(f"{rootfs.name} {made_of}".encode()).hexdigest()[:16]
    name = f"{SINGLEUSER_REPO}:{key}"
    out = cache_root() / f"singleuser-{key}.tar"
    if out.exists():
        return name, out
    for old in cache_root().glob("singleuser-*.tar"):  # one kept: each is gigabytes
        old.unlink()
    with tempfile.TemporaryDirectory(dir=cache_root()) as d:
        base = Path(d) / "base.tar"
        _tar_dir(rootfs, base, extra=["--exclude=./.complete", "--exclude=./debootstrap"])
        # the account, the home and the environment, in a layer of their own
        top = Path(d) / "top"
        (top / "etc").mkdir(parents=True)
        passwd = (rootfs / "etc" / "passwd").read_text()
        (top / "etc" / "passwd").write_text(
            passwd + f"jovyan:x:{NOTEBOOK_UID}:{NOTEBOOK_GID}::/home/jovyan:/bin/bash\n")
        (top / "home" / "jovyan").mkdir(parents=True)
        os.chown(top / "home" / "jovyan", NOTEBOOK_UID, NOTEBOOK_GID)
        env_layer = Path(d) / "env.tar"
        subprocess.run(["tar", "--numeric-owner", "-cf", str(env_layer), "-C", str(top), "etc", "home",
                        "-C", "/", "--exclude=__pycache__", str(venv).lstrip("/")], check=True)
        write_oci_archive(out, name, [base, env_layer], {
            "User": f"{NOTEBOOK_UID}:{NOTEBOOK_GID}",
            "WorkingDir": "/home/jovyan",
            "Env": [f"PATH={venv}/bin:/usr/local/bin:/usr/bin:/bin", f"VIRTUAL_ENV={venv}",
                    "HOME=/home/jovyan", "LANG=C.UTF-8", "LC_ALL=C.UTF-8", "TF_USE_LEGACY_KERAS=1"],
            "Entrypoint": ["/usr/bin/tini", "-g", "--"],
            "Cmd": ["jupyterhub-singleuser"],
        })
    return name, out
