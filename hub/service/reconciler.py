"""The reconciler: closes the notebook allocations of servers the hub no longer has, and stops
the training jobs of people the hub no longer has."""

from __future__ import annotations

import asyncio
import time

from tornado.ioloop import PeriodicCallback

from gpulab.hub.quota.ledger import Ledger
from gpulab.hub.service.base import log
from gpulab.hub.service.hubapi import HubDirectory

async def close_orphaned_notebooks(ledger: Ledger, directory: HubDirectory,
                                   grace: float) -> list | None:
    """Close the open notebook allocations whose server the hub no longer has.

    A hub that stops or crashes in the middle of a spawn (a ``helm upgrade`` while a GPU image
    is being pulled, the hub pod evicted) never learns that the server it was starting is gone,
    so the GPUs admitted for it would stay held for ever. The hub's own list of servers is the
    truth: an allocation whose ``(user, server)`` the hub does not list as running, starting or
    stopping is closed. An allocation younger than ``grace`` seconds is left alone (it may
    belong to a spawn that began after the hub's list was read). Returns the closed
    allocations, or None when the hub's list could not be read (then nothing is closed).
    """
    try:
        active = await directory.active_servers()
    except Exception as e:  # the hub restarting: try again next time
        log.warning("Could not list the hub's servers (%s); no notebook allocation closed", e)
        return None
    if active is None:
        log.warning("The hub does not show servers to the gpulab service (no read:servers "
                    "scope); notebook allocations of vanished servers are not closed")
        return None
    now = time.time()
    closed = []
    for a in await asyncio.to_thread(ledger.open_allocations, kind="notebook"):
        if (a.user, a.holder) in active or now - a.started_at < grace:
            continue
        done = await asyncio.to_thread(ledger.release, a.id,
                                       "server gone: the hub no longer has it")
        if done is not None:
            log.warning("Closed the allocation of %s's server '%s' (%d GPUs): the hub no "
                        "longer has that server", a.user, a.holder, a.gpus)
            closed.append(done)
    return closed


async def stop_jobs_of_departed(jobs, directory: HubDirectory) -> list[tuple[str, str]] | None:
    """Stop the jobs, running or waiting, of people whose hub account was deleted.

    Deleting a person in the hub stops their servers, but their training jobs are the gpulab
    service's: without this they would run on, holding GPUs nobody can stop but an admin, and
    keep their place in the queue. A job's owner who is missing from the hub's user list is
    looked up once more by name, and only the hub's 404 counts as gone (a person made after
    the list was read, or a hub that answers badly, stops nothing). The hub answers 404 for a
    user a token may not see too, so nothing is stopped unless the service reads every user
    (its role's ``read:users``, unfiltered). Returns the stopped ``(user, job)``, or None
    when the hub could not be asked."""
    owners = await asyncio.to_thread(jobs.active_owners)
    if not owners:
        return []
    try:
        if not await directory.reads_every_user():
            if not getattr(directory, "_told_narrow", False):
                directory._told_narrow = True
                log.warning("The gpulab service's role does not read every user "
                            "(read:users): the jobs of deleted accounts are not stopped")
            return None
        # the cached list (a few seconds old): someone deleted since is stopped next time,
        # someone made since is looked up
        known = {u["name"] for u in await directory.users()}
        gone = {u: await directory.gone(u) for u in {u for u, _ in owners} - known}
    except Exception as e:  # the hub restarting: try again next time
        log.warning("Could not list the hub's users (%s); no job of a deleted account "
                    "stopped", e)
        return None
    stopped = []
    for user, name in owners:
        if not gone.get(user):
            continue
        try:
            await jobs.stop(user, name, reason=f"stopped: {user}'s account was deleted")
        except Exception:
            log.exception("Could not stop job %s/%s of a deleted account", user, name)
            continue
        log.warning("Stopped job %s/%s: the hub no longer has %s", user, name, user)
        stopped.append((user, name))
    return stopped


def start_notebook_reconciler(ledger: Ledger, directory: HubDirectory,
                              interval: float, jobs=None) -> PeriodicCallback | None:
    """Run `close_orphaned_notebooks` (and, with a job backend, `stop_jobs_of_departed`)
    every ``interval`` seconds (0: never); the grace for young allocations is the interval,
    at least 30 s."""
    if interval <= 0:
        return None
    grace = max(30.0, interval)
    busy = False

    async def tick():
        nonlocal busy
        if busy:
            return
        busy = True
        try:
            try:
                await close_orphaned_notebooks(ledger, directory, grace)
            except Exception:
                log.exception("Notebook allocation reconciler failed; retrying")
            if jobs is not None and not jobs.unavailable:
                try:
                    await stop_jobs_of_departed(jobs, directory)
                except Exception:
                    log.exception("Stopping the jobs of deleted accounts failed; retrying")
        finally:
            busy = False

    pc = PeriodicCallback(tick, interval * 1000)
    pc.start()
    return pc
