"""Exclusive GPU assignment inside one hub process.

A GPU belongs to at most one holder (a notebook server or, later, a training job) at a time.
Every claim has an id that the holder keeps in its state, so that a hub restart restores the
same assignment (`restore`) and a late release can never free someone else's claim.

The allocator knows nothing of JupyterHub or tornado: it raises `InsufficientGPUs` with the
facts, and the spawner turns them into words.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Callable

from .inventory import GPU, model_matches

@dataclass(frozen=True)
class Holder:
    """Who holds GPUs: kind ``notebook`` or ``job``, the owning user, and its name."""

    kind: str
    user: str
    name: str

    def describe(self) -> str:
        if self.kind == "notebook":
            return f"server '{self.name or 'default'}'"
        return f"{self.kind} '{self.name}'"


@dataclass
class Claim:
    id: str
    holder: Holder
    gpus: tuple[GPU, ...]
    # Returns False once the holder is known to be gone (e.g. its process died).
    alive: Callable[[], bool] | None = field(default=None, compare=False)


class GPUAllocationError(Exception):
    """Base of the allocator's errors; ``message`` is written for the person asking."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InsufficientGPUs(GPUAllocationError):
    """Not enough free GPUs (of the asked model) for a request, with what holds the rest."""

    def __init__(
        self,
        *,
        requested: int,
        model: str | None,
        matching: int,
        free: int,
        mine: list[tuple[Holder, int]],
        others: int,
    ):
        self.requested = requested
        self.model = model
        self.matching = matching
        self.free = free
        self.mine = mine
        self.others = others
        super().__init__(self._compose())

    def _compose(self) -> str:
        gpus = "GPU" if self.requested == 1 else "GPUs"
        of_model = f" of model {self.model}" if self.model else ""
        if self.matching == 0:
            return f"This machine has no GPU{of_model}."
        if self.requested > self.matching:
            return (
                f"This request needs {self.requested} {gpus}{of_model}, "
                f"but this machine has only {self.matching}."
            )
        parts = []
        if self.mine:
            parts.append(
                "your "
                + ", ".join(f"{h.describe()} ({n})" for h, n in self.mine)
            )
        if self.others:
            parts.append(f"{self.others} held by other users")
        held = self.matching - self.free
        return (
            f"Not enough free GPUs{of_model}: this request needs {self.requested}, "
            f"{self.free} of {self.matching} {'is' if self.free == 1 else 'are'} free. "
            f"In use ({held}): {'; '.join(parts)}. "
            "Stop one of your servers, choose a profile with fewer GPUs, or try again later."
        )


class ClaimConflict(GPUAllocationError):
    """A restored claim names a GPU that another holder already has."""


class GPUAllocator:
    """Hands out whole GPUs exclusively; one instance per hub process.

    All methods are synchronous and run on the hub's event loop, so a claim is atomic with
    respect to every other claim in the process.
    """

    def __init__(self, gpus: list[GPU], log: logging.Logger | None = None):
        self.log = log or logging.getLogger("gpulab.allocator")
        self.gpus = list(gpus)
        self._claims: dict[str, Claim] = {}

    # -- queries -------------------------------------------------------------------------

    def claims(self) -> list[Claim]:
        return list(self._claims.values())

    def get(self, claim_id: str) -> Claim | None:
        return self._claims.get(claim_id)

    def held_indices(self) -> set[int]:
        return {g.index for c in self._claims.values() for g in c.gpus}

    def free_gpus(self, model: str | None = None) -> list[GPU]:
        held = self.held_indices()
        return [g for g in self.gpus if g.index not in held and model_matches(model, g.model)]

    def holdings_of(self, user: str) -> list[Claim]:
        return [c for c in self._claims.values() if c.holder.user == user]

    # -- changes -------------------------------------------------------------------------

    def reap(self) -> list[Claim]:
        """Release the claims whose holder reports itself gone; returns them."""
        gone = []
        for claim in list(self._claims.values()):
            if claim.alive is None:
                continue
            try:
                alive = claim.alive()
            except Exception:  # a probe that cannot tell keeps the claim
                self.log.exception("Liveness probe failed for %s", claim.holder)
                alive = True
            if not alive:
                self.log.warning(
                    "Releasing GPUs %s of %s:%s, whose process is gone",
                    [g.index for g in claim.gpus],
                    claim.holder.user,
                    claim.holder.name,
                )
                del self._claims[claim.id]
                gone.append(claim)
        return gone

    def claim(
        self,
        holder: Holder,
        count: int,
        model: str | None = None,
        alive: Callable[[], bool] | None = None,
    ) -> Claim:
        """Claim `count` free GPUs (of `model`) for `holder`, all or none."""
        if count < 0:
            raise GPUAllocationError(f"A GPU count cannot be negative (got {count}).")
        free = self.free_gpus(model)
        if len(free) < count:
            # Holders that died since the hub last looked must not keep GPUs from others.
            if self.reap():
                free = self.free_gpus(model)
        if len(free) < count:
            raise self._insufficient(holder, count, model, len(free))
        claim = Claim(id=uuid.uuid4().hex, holder=holder, gpus=tuple(free[:count]), alive=alive)
        self._claims[claim.id] = claim
        self.log.info(
            "GPUs %s assigned to %s:%s (%s)",
            [g.index for g in claim.gpus],
            holder.user,
            holder.name,
            holder.kind,
        )
        return claim

    def restore(
        self,
        claim_id: str,
        holder: Holder,
        indices: list[int],
        alive: Callable[[], bool] | None = None,
    ) -> Claim:
        """Re-register a claim kept in a holder's saved state (after a hub restart)."""
        existing = self._claims.get(claim_id)
        if existing is not None:
            existing.alive = alive or existing.alive
            return existing
        by_index = {g.index: g for g in self.gpus}
        missing = [i for i in indices if i not in by_index]
        if missing:
            raise ClaimConflict(
                f"GPU(s) {missing} of {holder.user}:{holder.name} are not in this "
                "machine's inventory any more."
            )
        taken = set(indices) & self.held_indices()
        if taken:
            raise ClaimConflict(
                f"GPU(s) {sorted(taken)} of {holder.user}:{holder.name} are already held by "
                "another holder; not assigning them twice."
            )
        claim = Claim(
            id=claim_id,
            holder=holder,
            gpus=tuple(by_index[i] for i in indices),
            alive=alive,
        )
        self._claims[claim_id] = claim
        self.log.info("GPUs %s restored to %s:%s", indices, holder.user, holder.name)
        return claim

    def set_probe(self, claim_id: str, alive: Callable[[], bool] | None) -> None:
        claim = self._claims.get(claim_id)
        if claim is not None:
            claim.alive = alive

    def release(self, claim_id: str) -> Claim | None:
        """Free a claim's GPUs; releasing an unknown or already-freed claim is a no-op."""
        claim = self._claims.pop(claim_id, None)
        if claim is not None:
            self.log.info(
                "GPUs %s released by %s:%s",
                [g.index for g in claim.gpus],
                claim.holder.user,
                claim.holder.name,
            )
        return claim

    def _insufficient(self, holder: Holder, count: int, model: str | None, free: int):
        matching = [g for g in self.gpus if model_matches(model, g.model)]
        matching_idx = {g.index for g in matching}
        mine: list[tuple[Holder, int]] = []
        others = 0
        for claim in self._claims.values():
            n = sum(1 for g in claim.gpus if g.index in matching_idx)
            if not n:
                continue
            if claim.holder.user == holder.user:
                mine.append((claim.holder, n))
            else:
                others += n
        return InsufficientGPUs(
            requested=count,
            model=model,
            matching=len(matching),
            free=free,
            mine=mine,
            others=others,
        )
