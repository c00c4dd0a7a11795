"""jupyterhub-idle-culler as `gpulab up` runs it: it ends when the hub that started it is gone.

The hub starts the culler as a managed service; if the hub itself dies (kill -9, a crash), the
stock culler would go on retrying against a hub that is not there, and a new `gpulab up` would
start a second one beside it. This wrapper watches its parent and exits with it, as the
gpulab service does. ``python -m gpulab.hub.deploy.culler --timeout=3600 ...`` takes the culler's
own arguments.
"""

from __future__ import annotations

import os
import signal
import threading
import time


def _exit_with(parent: int, every: float = 0.5) -> None:
    while os.getppid() == parent:
        time.sleep(every)
    os._exit(0)


def _stop(signum, _frame) -> None:
    # the hub stops its services with SIGINT, and Ctrl-C at the terminal of `gpulab up` sends
    # another: the stock culler's shutdown then sat until the hub's 10 s interrupt timeout
    # (no state to save: a cull round cut short is redone by the next culler)
    os._exit(0)


def main() -> None:
    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stop)
    from jupyterhub_idle_culler import main as cull

    cull()


if __name__ == "__main__":
    main()
