"""What scripts/setup.sh must install, from the stamp the last install left (stdlib only:
it runs with the system's Python before the environment exists).

The stamp (``<venv>/.gpulab-installed``) is one line: the extras installed, comma-separated,
then the hash of the sources installed. An environment needs no install when its sources are
the same and its extras include every extra asked for now: `scripts/test.sh` installs
``tf,test`` and `scripts/run.sh` asks for ``tf`` only, and neither undoes the other. ``tf-cuda``
(TensorFlow with NVIDIA's libraries) serves where ``tf`` is asked for. An install installs the
union of what was there and what is asked for (pip removes nothing), and the stamp says so.

    python3 scripts/stamp.py STAMP_FILE EXTRAS HASH
prints ``ok`` (nothing to install) or ``install <extras>``.
"""

from __future__ import annotations

import sys

#: an installed extra that serves another one asked for
SERVES = {"tf-cuda": {"tf"}}


def parse(stamp: str) -> tuple[set[str], str]:
    """``(extras, hash)`` of a stamp line; an old or damaged stamp gives no extras."""
    parts = stamp.split()
    if len(parts) != 2:
        return set(), ""
    return {e for e in parts[0].split(",") if e}, parts[1]


def served(installed: set[str]) -> set[str]:
    return installed | {s for e in installed for s in SERVES.get(e, ())}


def plan(stamp: str, extras: str, source_hash: str) -> str | None:
    """None when nothing needs installing; otherwise the extras to install (and stamp)."""
    installed, installed_hash = parse(stamp)
    wanted = {e for e in extras.split(",") if e}
    if installed_hash == source_hash and wanted <= served(installed):
        return None
    union = installed | wanted
    # one TensorFlow: asked for CUDA, the plain one is not kept as a separate extra
    if "tf-cuda" in union:
        union.discard("tf")
    return ",".join(sorted(union))


def line(extras: str, source_hash: str) -> str:
    return f"{extras} {source_hash}"


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[-2], file=sys.stderr)
        return 2
    path, extras, source_hash = argv
    try:
        with open(path, encoding="utf-8") as f:
            stamp = f.read().strip()
    except OSError:
        stamp = ""
    todo = plan(stamp, extras, source_hash)
    print("ok" if todo is None else f"install {todo}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
