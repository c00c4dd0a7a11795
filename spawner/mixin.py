"""`GPUSpawnerMixin`: what the local and the Kubernetes spawner share.

It turns a server's ``user_options`` into one GPU profile, admits the profile's GPUs before
the server starts (all of them or none, refused at once with a message a person can act on),
keeps the assignment in the spawner's state so that a hub restart restores it, and releases
it whenever JupyterHub clears that state: on stop, when the server died, when it was culled.

The concrete spawner provides ``profile_list`` (KubeSpawner's trait, or LocalGPUSpawner's of
the same shape) and ``gpu_probe()`` (how to tell that its server is still alive).
"""

from __future__ import annotations

import html
import inspect
import os
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, select_autoescape
from tornado import web

from .allocator import (
    ClaimConflict,
    GPUAllocationError,
    GPUAllocator,
    Holder,
)
from .inventory import GPU, GPUInventory, gpus_json, model_matches
from .profiles import (
    GPUProfile,
    ProfileError,
    choose_profile,
    default_profile_list,
    parse_profiles,
)

_templates = Environment(
    loader=FileSystemLoader(Path(__file__).parent / "templates"),
    autoescape=select_autoescape(["html"]),
)

#: the only key a user may put in ``user_options`` (form or REST API)
USER_OPTION_KEYS = {"profile"}


class SpawnRefused(web.HTTPError):
    """A spawn refused before anything started; JupyterHub shows ``jupyterhub_message``.

    Status 400 for bad options, 409 when the GPUs are not free now.
    """

    def __init__(self, status_code: int, message: str):
        super().__init__(status_code, "%s", message)
        self.jupyterhub_message = message
        self.jupyterhub_html_message = html.escape(message)


def hub_allocator(config=None) -> GPUAllocator:
    """The one allocator of this hub process, over `GPUInventory`'s GPUs."""
    inventory = GPUInventory.instance(config=config)
    allocator = getattr(inventory, "_allocator", None)
    if allocator is None:
        allocator = inventory._allocator = GPUAllocator(inventory.gpus, log=inventory.log)
    return allocator


class GPUSpawnerMixin:
    """GPU profiles, admission and release for a JupyterHub spawner (mix in first)."""

    gpu_claim_id = ""  # id of this server's GPU claim ('' when it holds none)

    _gpu_claim = None  # the allocator's Claim while this server holds GPUs

    # -- profiles --------------------------------------------------------------------------

    @property
    def gpu_allocator(self) -> GPUAllocator:
        return hub_allocator(self.config)

    def gpu_profiles(self) -> list[GPUProfile]:
        """The configured profiles, parsed; the defaults when none are configured."""
        configured = self.profile_list
        if callable(configured):
            configured = configured(self)
            if inspect.isawaitable(configured):  # pragma: no cover - async lists: kube mode
                raise ProfileError("An async profile_list is only supported by KubeGPUSpawner.")
        if not configured:
            configured = default_profile_list(len(self.gpu_allocator.gpus))
        return parse_profiles(configured)

    def selected_profile(self, user_options: dict | None = None) -> GPUProfile:
        """Validate `user_options` and return the profile they name (400 when they are bad)."""
        options = self.user_options if user_options is None else user_options
        if options is None:
            options = {}
        if not isinstance(options, dict):
            raise SpawnRefused(400, "Server options must be a JSON object.")
        profiles = self.gpu_profiles()
        unknown = sorted(set(options) - USER_OPTION_KEYS)
        if unknown:
            raise SpawnRefused(
                400,
                f"Unknown server option(s): {', '.join(unknown)}. Choose a profile "
                f"('profile': one of {', '.join(p.slug for p in profiles)}).",
            )
        slug = options.get("profile")
        if slug is not None and not isinstance(slug, str):
            raise SpawnRefused(400, f"'profile' must be a profile name, got {slug!r}.")
        try:
            return choose_profile(profiles, slug or None)
        except LookupError:
            raise SpawnRefused(
                400,
                f"There is no profile {slug!r}. Choose one of: "
                f"{', '.join(p.slug for p in profiles)}.",
            ) from None

    # -- spawn form ------------------------------------------------------------------------

    def options_from_form(self, formdata):
        """The form posts one field, ``profile``; anything else is refused with 400."""
        extra = sorted(k for k in formdata if k not in ("profile", "_xsrf"))
        if extra:
            raise SpawnRefused(400, f"Unknown form field(s): {', '.join(extra)}.")
        values = formdata.get("profile") or []
        if len(values) != 1:
            raise SpawnRefused(400, "Choose exactly one profile.")
        options = {"profile": values[0]}
        self.selected_profile(options)  # refuse a tampered value before anything starts
        return options

    def gpu_form_context(self) -> dict:
        allocator = self.gpu_allocator
        allocator.reap()
        gpus = allocator.gpus
        held = allocator.held_indices()
        rows = []
        for p in self.gpu_profiles():
            matching = [g for g in gpus if model_matches(p.model, g.model)]
            free = [g for g in matching if g.index not in held]
            if p.gpus == 0:
                available, why = True, ""
            elif len(matching) < p.gpus:
                available = False
                why = f"this machine has {len(matching)} matching GPU(s)"
            elif len(free) < p.gpus:
                available, why = False, f"only {len(free)} free now"
            else:
                available, why = True, ""
            rows.append(
                {
                    "profile": p,
                    "free": len(free),
                    "total": len(matching),
                    "available": available,
                    "why": why,
                }
            )
        if not any(r["profile"].default and r["available"] for r in rows):
            first = next((r for r in rows if r["available"]), rows[0] if rows else None)
            checked = first["profile"].slug if first else None
        else:
            checked = next(r["profile"].slug for r in rows if r["profile"].default)
        mine = [
            (c.holder.describe(), len(c.gpus), [g.index for g in c.gpus])
            for c in allocator.holdings_of(self.user.name)
        ]
        return {
            "rows": rows,
            "checked": checked,
            "mine": mine,
            "free_total": len(gpus) - len(held),
            "total": len(gpus),
            "simulated": any(g.simulated for g in gpus),
        }

    def render_gpu_form(self) -> str:
        return _templates.get_template("spawn_form.html").render(**self.gpu_form_context())

    # -- admission -------------------------------------------------------------------------

    @property
    def gpu_holder(self) -> Holder:
        return Holder(kind="notebook", user=self.user.name, name=self.name or "")

    def gpu_probe(self):
        """A callable telling whether this server is still alive, or None (always trusted)."""
        return None

    def admit_gpus(self, profile: GPUProfile) -> tuple[GPU, ...]:
        """Claim the profile's GPUs for this server, or raise `SpawnRefused` (409)."""
        if self.gpu_claim_id:
            self.release_gpus()
        if profile.gpus == 0:
            return ()
        try:
            claim = self.gpu_allocator.claim(self.gpu_holder, profile.gpus, profile.model)
        except GPUAllocationError as e:
            raise SpawnRefused(409, f"Cannot start with profile '{profile.display_name}'. "
                               + e.message) from e
        self._gpu_claim = claim
        self.gpu_claim_id = claim.id
        return claim.gpus

    def release_gpus(self) -> None:
        if self.gpu_claim_id:
            self.gpu_allocator.release(self.gpu_claim_id)
        self._gpu_claim = None
        self.gpu_claim_id = ""

    @property
    def assigned_gpus(self) -> tuple[GPU, ...]:
        return self._gpu_claim.gpus if self._gpu_claim is not None else ()

    def gpu_env(self) -> dict[str, str]:
        """The variables that bind a process to exactly this server's GPUs."""
        gpus = self.assigned_gpus
        indices = ",".join(str(g.index) for g in gpus)
        return {
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",  # indices as nvidia-smi and NVML number them
            "CUDA_VISIBLE_DEVICES": indices,
            "NVIDIA_VISIBLE_DEVICES": indices or "void",
            "GPULAB_GPUS": gpus_json(gpus),
        }

    # -- state: recovered after a hub restart, cleared (and released) on stop ---------------

    def get_state(self):
        state = super().get_state()
        if self.gpu_claim_id and self._gpu_claim is not None:
            state["gpulab_claim"] = {
                "id": self.gpu_claim_id,
                "gpus": [g.index for g in self._gpu_claim.gpus],
            }
        return state

    def load_state(self, state):
        super().load_state(state)
        saved = state.get("gpulab_claim") if state else None
        if not saved:
            return
        try:
            claim = self.gpu_allocator.restore(
                saved["id"], self.gpu_holder, list(saved["gpus"]), alive=self.gpu_probe()
            )
        except ClaimConflict as e:
            self.log.error("Not restoring GPUs of %s: %s", self._log_name, e)
            return
        self._gpu_claim = claim
        self.gpu_claim_id = claim.id

    def clear_state(self):
        super().clear_state()
        self.release_gpus()


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (zombies count as gone); 0 or negative: no process."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
