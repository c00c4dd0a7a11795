"""`GPUSpawnerMixin`: what the local and the Kubernetes spawner share.

It turns a server's ``user_options`` (KubeSpawner's shape: a profile and its options' choices)
into one GPU profile and its overrides, admits the resulting GPUs before
the server starts (all of them or none, refused at once with a message a person can act on),
keeps the assignment in the spawner's state so that a hub restart restores it, and releases
it whenever JupyterHub clears that state: on stop, when the server died, when it was culled.

The concrete spawner provides ``profile_list`` (KubeSpawner's trait, or LocalGPUSpawner's of
the same shape) and ``gpu_probe()`` (how to tell that its server is still alive).
"""

from __future__ import annotations

import asyncio
import copy
import html
import inspect
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, select_autoescape
from tornado import web

from gpulab.hub.quota import events
from gpulab.hub.quota.ledger import AdmissionRefused, Allocation, DeviceInfo, Ledger, Request
from gpulab.hub.quota.policy import Quota, never_fits
from gpulab.hub.quota.settings import GPULedger

from gpulab.hub.machine.gpuusage import device_usage
from gpulab.hub.machine.inventory import GPU, GPUInventory, gpus_json, model_matches
from .profiles import (
    UNLISTED_SUFFIX,
    GPUProfile,
    OptionError,
    ProfileError,
    Selection,
    default_profile_list,
    is_plain_number,
    options_from_formdata,
    parse_profiles,
    select,
    visible_profiles,
)

log = logging.getLogger(__name__)

_templates = Environment(
    loader=FileSystemLoader(Path(__file__).parent / "templates"),
    autoescape=select_autoescape(["html"]),
)


class SpawnRefused(web.HTTPError):
    """A spawn refused before anything started; JupyterHub shows ``jupyterhub_message``.

    Status 400 for bad options, 409 when the GPUs are not free now.
    """

    def __init__(self, status_code: int, message: str):
        super().__init__(status_code, "%s", message)
        self.jupyterhub_message = message
        self.jupyterhub_html_message = html.escape(message)


class OptionRefused(SpawnRefused, ValueError):
    """Bad ``user_options`` (400); a ValueError too, as KubeSpawner raises for them."""


@dataclass(frozen=True)
class LedgerView:
    """What the spawn form and the quota summary show of the ledger, read in one go in a
    worker thread (`GPUSpawnerMixin.gpu_ledger_view`): the open allocations (all, or the
    user's), and the user's quota with where it comes from (``user``, ``group …``, ``default``,
    ``none``)."""

    allocations: list[Allocation]
    quota: Quota | None
    source: str


#: allocation id -> callable telling whether its server still runs (this hub process)
_probes: dict[str, object] = {}


#: made once, by whichever thread asks first (the spawn form asks from a worker thread)
_ledger_lock = threading.Lock()


def hub_ledger(config=None, assigns_devices: bool = True) -> Ledger:
    """The ledger of this hub process, migrated, with the machine's GPUs recorded.

    Its first call migrates the database: the hub's event loop asks it through
    `asyncio.to_thread` (`GPUSpawnerMixin.gpu_ledger_view`, `admit_gpus`)."""
    conf = GPULedger.instance(config=config)
    if conf._ledger is not None:
        return conf._ledger
    with _ledger_lock:
        if conf._ledger is None:
            conf._ledger = _open_ledger(conf, config, assigns_devices)
    return conf._ledger


def _open_ledger(conf: GPULedger, config, assigns_devices: bool) -> Ledger:
    ledger = Ledger(conf.db_url, pool=conf.pool)
    ledger.migrate()
    if assigns_devices:
        inventory = GPUInventory.instance(config=config)
        ledger.sync_inventory(
            DeviceInfo(g.index, g.uuid, g.model, g.memory_mib, g.simulated)
            for g in inventory.gpus
        )
    else:
        ledger.ensure_pool(assigns_devices=False)
    return ledger


def adopted_allocations() -> set[str]:
    """Ids of the notebook allocations that servers of this hub process hold."""
    return set(_probes)


def reap_dead_servers(ledger: Ledger) -> int:
    """Release the allocations whose server is known to be gone; returns how many."""
    n = 0
    for alloc_id, probe in list(_probes.items()):
        if probe is None:
            continue
        try:
            alive = probe()
        except Exception:  # a probe that cannot tell keeps the GPUs
            alive = True
        if not alive:
            _probes.pop(alloc_id, None)
            if ledger.release(alloc_id, "server process gone") is not None:
                n += 1
    return n


class LineAhead(AdmissionRefused):
    """Others wait in the GPU queue: a request that may wait takes its place behind them
    rather than taking free GPUs ahead of them."""

    metric_reason = "line_ahead"  # its refusals' label (`gpulab.hub.quota.events`)


def _admit(ledger: Ledger, request: Request, keep: str = "", line=None) -> Allocation:
    """One admission (in a worker thread): servers found gone are reaped and it is tried again
    once, so that they do not keep GPUs from anyone.

    JupyterHub starts a server only when it holds it stopped, so an allocation still open for
    the same server (an earlier start that failed before it could release, a spawner replaced
    after a failure) is left over: it is closed first (all but ``keep``)."""
    for old in ledger.open_allocations(user=request.user, kind=request.kind):
        if old.holder == request.holder and old.id != keep:
            _probes.pop(old.id, None)
            if ledger.release(old.id, "left by an earlier start of the same server"):
                log.warning("Closed allocation %s of %s/%s, left by an earlier start",
                            old.id, request.user, request.holder)
    waiting = line.waiting_count() if line is not None else 0
    if waiting:
        raise LineAhead(f"{waiting} request{'s' if waiting != 1 else ''} already "
                        f"wait{'' if waiting != 1 else 's'} for GPUs.")
    try:
        return ledger.admit(request)
    except AdmissionRefused:
        if not reap_dead_servers(ledger):
            raise
        return ledger.admit(request)


class GPUSpawnerMixin:
    """GPU profiles, admission and release for a JupyterHub spawner (mix in first)."""

    gpu_claim_id = ""  # id of this server's ledger allocation ('' when it holds none)

    #: True where the hub hands out device indices (local); False on Kubernetes
    gpu_assigns_devices = True

    _gpu_allocation: Allocation | None = None

    @property
    def gpu_ledger(self) -> Ledger:
        return hub_ledger(self.config, self.gpu_assigns_devices)

    @property
    def gpu_inventory(self) -> list[GPU]:
        return GPUInventory.instance(config=self.config).gpus

    @property
    def user_groups(self) -> tuple[str, ...]:
        return tuple(sorted(g.name for g in getattr(self.user, "groups", []) or []))

    def gpu_profiles(self) -> list[GPUProfile]:
        """The configured profiles, parsed; the defaults when none are configured."""
        configured = self.profile_list
        if callable(configured):
            configured = configured(self)
            if inspect.isawaitable(configured):  # pragma: no cover - async lists: kube mode
                raise ProfileError("An async profile_list is only supported by KubeGPUSpawner.")
        if not configured:
            configured = default_profile_list(len(self.gpu_inventory))
        return parse_profiles(configured)

    def gpu_visible_profiles(self) -> list[GPUProfile]:
        """The profiles this server's user may see and start (``allowed_groups``)."""
        return visible_profiles(self.gpu_profiles(), self.user_groups)

    # -- whose options: gpulab's form, or the operator's own ------------------------------

    #: JupyterHub's ``options_from_form`` of the base class, used beside an operator's form
    def _base_options_from_form(self, formdata):
        return formdata

    def _is_gpu_hook(self, name: str, method: str) -> bool:
        """Whether trait `name` still has gpulab's default, the bound method `method`."""
        return getattr(getattr(self, name), "__func__", None) is getattr(type(self), method)

    @property
    def gpu_operator_form(self) -> bool:
        """Whether the operator configured an ``options_form`` of their own."""
        return bool(self.options_form) and not self._is_gpu_hook("options_form", "_gpu_form")

    @property
    def gpu_strict_options(self) -> bool:
        """Whether ``user_options`` are gpulab's alone (its form, its ``options_from_form``, no
        ``apply_user_options`` of the operator's): then any other key is refused. Otherwise
        keys gpulab does not know are the operator's, and left to their hooks."""
        return (not self.gpu_operator_form
                and self._is_gpu_hook("options_from_form", "_gpu_options_from_form")
                and self._is_gpu_hook("apply_user_options", "_gpu_apply_user_options"))

    def _gpu_apply_user_options(self, spawner, user_options):
        """gpulab applies ``user_options`` when the server starts (as KubeSpawner does)."""

    def gpu_selection(self, user_options: dict | None = None) -> Selection:
        """Check `user_options` and return the profile and overrides they choose (400 when
        they are bad). Keys the operator's own hooks handle are left alone."""
        options = self.user_options if user_options is None else user_options
        try:
            return select(self.gpu_profiles(), options or {}, groups=self.user_groups,
                          strict=self.gpu_strict_options,
                          extra_keys=self.gpu_extra_option_keys())
        except OptionError as e:
            raise OptionRefused(400, str(e)) from e

    def gpu_extra_option_keys(self) -> tuple[str, ...]:
        """``user_options`` keys of this spawner's own beside the profiles' (and the spawn
        form's fields of the same names); none here."""
        return ()

    def gpu_wait_choices(self) -> tuple[int, ...]:
        """The waits in the GPU queue (minutes) the spawn form offers; none here: the server
        is admitted now or refused (LocalGPUSpawner's notebooks may wait)."""
        return ()

    def selected_profile(self, user_options: dict | None = None) -> GPUProfile:
        """The profile `user_options` choose (as configured, before its options apply)."""
        return self.gpu_selection(user_options).profile

    # -- overrides: each start's own, undone before the next ---------------------------------

    def gpu_undo_overrides(self) -> None:
        """Put back the traits the previous start's profile changed, each to its value before
        that start, unless something changed it since (the operator's `apply_user_options`,
        group overrides or `pre_spawn_hook` of this start: theirs stays)."""
        for name, (before, after) in self.__dict__.pop("_gpu_overridden", {}).items():
            if _same(getattr(self, name), after):
                setattr(self, name, before)

    def gpu_traits_before(self, names) -> dict:
        return {n: copy.deepcopy(getattr(self, n)) for n in names}

    def gpu_record_overrides(self, before: dict) -> None:
        """Remember the traits this start set (`before`: their values before it)."""
        self._gpu_overridden = {n: (v, copy.deepcopy(getattr(self, n)))
                                for n, v in before.items() if not _same(getattr(self, n), v)}

    # -- spawn form ------------------------------------------------------------------------

    def _gpu_options_from_form(self, formdata):
        """The form's fields as ``user_options``, KubeSpawner's way: ``{"profile": <slug>,
        <option>: <choice>, "<option>--unlisted-choice": <text>}``; the spawner's own fields
        (`gpu_extra_option_keys`) with plain numbers as numbers; any other field passed
        through as the base class passes the form (a list of strings). Beside an operator's
        own ``options_form``, the base class's reading (their fields; a ``profile`` among them
        still chooses the GPU profile).

        Nothing is refused here: as KubeSpawner's and JupyterHub's contract says, this only
        builds ``user_options``; they are checked when the server starts
        (`gpu_selection` in ``load_user_options`` / ``start``: an unknown profile or choice,
        a typed text its ``validation_regex`` refuses, a field gpulab does not know, several
        profiles), with a 400 (`OptionRefused`, a ValueError) whose message JupyterHub shows on
        the form again."""
        if self.gpu_operator_form:
            return self._base_options_from_form(formdata)
        options, other = options_from_formdata(formdata)
        profiles = formdata.get("profile") or []
        if len(profiles) > 1:  # refused at start: "'profile' must be a profile name"
            options["profile"] = list(profiles)
        for key in self.gpu_extra_option_keys():
            if key in other:
                other.remove(key)
                value = (formdata.get(key) or [""])[0]
                options[key] = (int(value) if is_plain_number(value) and len(value) <= 6
                                else value)
        for key in other:  # the base class's passthrough; refused at start unless an
            options[key] = formdata[key]  # operator's hook of their own takes them
        return options

    async def gpu_ledger_view(self, *, reap: bool = False, mine_only: bool = False) -> LedgerView:
        """What the spawn form and the quota summary read of the ledger, read in a worker
        thread: the hub's event loop never waits for the ledger (its lock may be held by the
        gpulab service or by another spawn's admission). With `reap`, the allocations of
        this hub's servers that are gone are closed first; with `mine_only`, only this
        user's open allocations are read. The user's name and groups are read here, on the
        loop (the hub's own database session is not for other threads)."""
        user, groups = self.user.name, self.user_groups
        config, assigns = self.config, self.gpu_assigns_devices

        def read() -> LedgerView:
            ledger = hub_ledger(config, assigns)
            if reap:
                reap_dead_servers(ledger)
            allocations = ledger.open_allocations(user=user) if mine_only \
                else ledger.open_allocations()
            quota, source = ledger.effective(user, groups)
            return LedgerView(allocations, quota, source)

        return await asyncio.to_thread(read)

    def gpu_form_context(self, view: LedgerView) -> dict:
        """What the profiles form shows, from the ledger's `view` (no I/O of the ledger's)."""
        gpus = self.gpu_inventory
        allocations = view.allocations
        held = {i for a in allocations for i in a.devices}
        mine = [a for a in allocations if a.user == self.user.name and a.gpus]
        quota, source = view.quota, view.source
        mine_gpus = sum(a.gpus for a in mine)
        rows = []
        saved = self.user_options if isinstance(self.user_options, dict) else {}
        waits = self.gpu_wait_choices()
        can_wait = any(m > 0 for m in waits)
        for p in self.gpu_visible_profiles():
            matching = [g for g in gpus if model_matches(p.model, g.model)]
            free = [g for g in matching if g.index not in held]
            if p.gpus == 0:
                available, why = True, ""
            elif self.gpu_assigns_devices and len(matching) < p.gpus:
                available = False
                why = f"this machine has {len(matching)} matching GPU(s)"
            elif (never := never_fits(quota, p.gpus)) is not None:
                available = False  # never, whatever is stopped: say so, not "stop something"
                why = never.short()
            elif quota is not None and mine_gpus + p.gpus > quota.max_gpus:
                available = False
                why = (f"over your quota ({quota.max_gpus} at once, {mine_gpus} in use: "
                       "stop a server or job first)")
            elif self.gpu_assigns_devices and len(free) < p.gpus:
                available, why = False, f"only {len(free)} free now"
            else:
                available, why = True, ""
            # busy now but not for ever: it may be chosen to wait in the queue
            later = can_wait and not available and why.startswith(("over your quota (",
                                                                    "only "))
            rows.append({"profile": p, "free": len(free), "total": len(matching),
                         "available": available or later, "later": later,
                         "now": available, "why": why,
                         "options": _option_rows(p, saved if saved.get("profile") == p.slug
                                                 else {})})
        again = next((r for r in rows if r["profile"].slug == saved.get("profile")
                      and r["now"]), None)
        if again is not None:  # the profile of the last start, as KubeSpawner's form does
            checked = again["profile"].slug
        elif not any(r["profile"].default and r["now"] for r in rows):
            first = next((r for r in rows if r["now"]), rows[0] if rows else None)
            checked = first["profile"].slug if first else None
        else:
            checked = next(r["profile"].slug for r in rows if r["profile"].default)
        return {
            "rows": rows,
            "checked": checked,
            "machine": self.gpu_assigns_devices,
            "mine": self._held(mine),
            "free_total": len(gpus) - len(held),
            "total": len(gpus),
            "simulated": any(g.simulated for g in gpus),
            "quota": quota.describe() if quota else "",
            "quota_source": source,
            "held": mine_gpus,
            "waits": _wait_rows(waits, saved) if can_wait else [],
        }

    def _held(self, mine) -> list[tuple]:
        """Each holding as the pages show it: what, how many GPUs, which devices, and how
        busy each device is now (NVML's latest figures; never waits for the driver)."""
        inventory = GPUInventory.instance(config=self.config)
        readings = inventory.usage_readings()
        by_index = {g.index: g for g in inventory.gpus}

        def text(i):
            g = by_index.get(i)
            return device_usage(i, g.uuid if g else "", bool(g and g.simulated),
                                readings.by_uuid, readings.by_index)["text"]

        return [(_describe(a), a.gpus, list(a.devices), [text(i) for i in a.devices])
                for a in mine]

    async def render_gpu_form(self) -> str:
        """The profiles form, with each profile's availability now (the ledger read in a
        worker thread, `gpu_ledger_view`). Braces outside its script are written as entities
        (names and saved choices may hold them; JupyterHub may render a form as a template
        again)."""
        view = await self.gpu_ledger_view(reap=True)
        page = _templates.get_template("spawn_form.html").render(**self.gpu_form_context(view))
        body, script, rest = page.partition("<script>")
        return body.replace("{", "&#123;").replace("}", "&#125;") + script + rest

    async def render_quota_summary(self) -> str:
        """The user's quota and what they hold now, as a paragraph above a spawn form (the
        ledger read in a worker thread, `gpu_ledger_view`). Braces are written as entities:
        JupyterHub renders an options form as a template again."""
        view = await self.gpu_ledger_view(mine_only=True)
        mine = [a for a in view.allocations if a.gpus]
        quota, source = view.quota, view.source
        html = _templates.get_template("quota_summary.html").render(
            quota=quota.describe() if quota else "", quota_source=source,
            held=sum(a.gpus for a in mine),
            mine=self._held(mine))
        return html.replace("{", "&#123;").replace("}", "&#125;")

    # -- admission -------------------------------------------------------------------------

    @property
    def gpu_holder_name(self) -> str:
        return self.name or "default"

    def gpu_probe(self):
        """A callable telling whether this server is still alive, or None (always trusted)."""
        return None

    async def admit_gpus(self, profile: GPUProfile) -> tuple[GPU, ...]:
        """Admit the profile's GPUs through the ledger, or raise `SpawnRefused` (409).

        The ledger's transaction runs in a worker thread: the hub's event loop never waits
        for the ledger's lock (which the gpulab service, or another spawn, may hold)."""
        if self.name == "default":
            # the ledger knows the default server ('') as "default": a named server of that
            # name would be taken for it (and an earlier start's allocation "of the same
            # server" closed while the default server still runs on its GPUs)
            raise SpawnRefused(400, "A named server cannot be called 'default': that is your "
                               "default server's name here. Choose another name.")
        if self.gpu_claim_id:
            await self.release_gpus_async()
        if profile.gpus == 0:
            return ()
        request = Request(user=self.user.name, kind="notebook", holder=self.gpu_holder_name,
                          gpus=profile.gpus, groups=self.user_groups, model=profile.model,
                          model_matches=model_matches)
        # opened in a worker thread too: the first use migrates the database
        ledger = await asyncio.to_thread(hub_ledger, self.config, self.gpu_assigns_devices)
        # the admission commits in its thread whatever happens here: a start cancelled
        # meanwhile (JupyterHub's start_timeout) must still release what it admitted
        line = self.gpu_line(ledger)
        admitted = asyncio.ensure_future(asyncio.to_thread(_admit, ledger, request, "", line))
        try:
            allocation = await asyncio.shield(admitted)
            events.admitted("notebook", "now")
        except AdmissionRefused as e:
            try:
                allocation = await self.gpu_when_refused(ledger, request, profile, e)
            except SpawnRefused as refusal:  # counted by its cause (/hub/metrics)
                cause = refusal.__cause__
                events.refused("notebook", cause if isinstance(cause, AdmissionRefused) else e)
                raise
        except asyncio.CancelledError:
            admitted.add_done_callback(lambda f: _release_late(ledger, f))
            raise
        self._adopt(allocation, probe=None)
        return self.assigned_gpus

    def gpu_line(self, ledger: Ledger):
        """The GPU queue this start would wait in (a `gpulab.hub.quota.waiting.Queue`): while
        anyone waits there, it queues behind them (`gpu_when_refused` gets a `LineAhead`).
        None here: admitted now or refused."""
        return None

    async def gpu_when_refused(self, ledger: Ledger, request: Request, profile: GPUProfile,
                               refused: AdmissionRefused) -> Allocation:
        """The ledger refused `request` now: raise `SpawnRefused` with its reason, or return
        an allocation obtained otherwise (LocalGPUSpawner: after waiting in the queue)."""
        raise SpawnRefused(refused.status, f"Cannot start with profile "
                           f"'{profile.display_name}'. " + refused.message) from refused

    def _adopt(self, allocation: Allocation, probe) -> None:
        self._gpu_allocation = allocation
        self.gpu_claim_id = allocation.id
        _probes[allocation.id] = probe

    def set_gpu_probe(self) -> None:
        if self.gpu_claim_id:
            _probes[self.gpu_claim_id] = self.gpu_probe()

    async def release_gpus_async(self, reason: str = "server stopped") -> None:
        """`release_gpus` with the ledger's transaction in a worker thread (from the hub's
        event loop: `stop`, a failed start)."""
        claim = self.gpu_claim_id
        if claim:
            _probes.pop(claim, None)
            await asyncio.to_thread(self.gpu_ledger.release, claim, reason)
        if self.gpu_claim_id == claim:  # not admitted again meanwhile
            self._gpu_allocation = None
            self.gpu_claim_id = ""

    def release_gpus(self, reason: str = "server stopped") -> None:
        """Close this server's allocation now (synchronous: `clear_state`, which JupyterHub
        calls after an awaited `stop` that has already released it)."""
        if self.gpu_claim_id:
            _probes.pop(self.gpu_claim_id, None)
            self.gpu_ledger.release(self.gpu_claim_id, reason)
        self._gpu_allocation = None
        self.gpu_claim_id = ""

    @property
    def assigned_gpus(self) -> tuple[GPU, ...]:
        if self._gpu_allocation is None:
            return ()
        by_index = {g.index: g for g in self.gpu_inventory}
        return tuple(by_index[i] for i in self._gpu_allocation.devices if i in by_index)

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
        if self.gpu_claim_id and self._gpu_allocation is not None:
            state["gpulab_claim"] = {
                "id": self.gpu_claim_id,
                "gpus": list(self._gpu_allocation.devices),
            }
        return state

    def load_state(self, state):
        super().load_state(state)
        saved = state.get("gpulab_claim") if state else None
        if not saved:
            return
        # a ledger read on the hub's thread, by necessity: JupyterHub calls load_state
        # synchronously when it makes the spawner (User._new_spawner), so it cannot wait for
        # a worker thread; one read by primary key, once per server after a hub restart
        allocation = self.gpu_ledger.get(saved.get("id", ""))
        if allocation is None or not allocation.open:
            self.log.error("Not restoring GPUs of %s: its allocation %s is %s in the ledger",
                           self._log_name, saved.get("id"),
                           "closed" if allocation else "missing")
            return
        if allocation.user != self.user.name or allocation.holder != self.gpu_holder_name:
            self.log.error("Not restoring GPUs of %s: allocation %s belongs to %s/%s",
                           self._log_name, allocation.id, allocation.user, allocation.holder)
            return
        self._adopt(allocation, probe=self.gpu_probe())

    def clear_state(self):
        super().clear_state()
        self.release_gpus()
        # the server stopped: its profile's and options' overrides go now, before the hooks
        # of a next start run (a hook that writes a trait afresh at every start, such as an
        # access token in `environment`, would otherwise keep a group profile's settings)
        for name, (before, _after) in self.__dict__.pop("_gpu_overridden", {}).items():
            setattr(self, name, before)


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that cannot tell count as changed
        return False


def _release_late(ledger: Ledger, admitted: asyncio.Future) -> None:
    """Release an allocation admitted for a start that was cancelled meanwhile."""
    if admitted.cancelled() or admitted.exception() is not None:
        return
    alloc = admitted.result()
    _probes.pop(alloc.id, None)
    asyncio.ensure_future(asyncio.to_thread(ledger.release, alloc.id, "server did not start"))


def _wait_rows(waits, saved: dict) -> list[tuple]:
    """The spawn form's "If the GPUs are busy" choices: (minutes, label, selected), the last
    start's choice selected (else "don't wait")."""
    from .queuewait import WAIT_KEY, wait_label

    chosen = saved.get(WAIT_KEY)
    if isinstance(chosen, list) and len(chosen) == 1:
        chosen = chosen[0]
    if isinstance(chosen, str) and is_plain_number(chosen) and len(chosen) <= 6:
        chosen = int(chosen)
    if chosen not in waits or isinstance(chosen, bool):
        chosen = 0
    return [(m, wait_label(m), m == chosen) for m in waits]


def _option_rows(profile: GPUProfile, saved: dict) -> list[dict]:
    """A profile's options as the form shows them, the saved choices (of the last start with
    this profile) selected, else the defaults."""
    rows = []
    for key, option in profile.options.items():
        unlisted = option["unlisted_choice"]
        typed = saved.get(key + UNLISTED_SUFFIX) if unlisted.get("enabled") else None
        # saved options are what was sent, also through the API: a list of one (a form's
        # shape) or anything else must not break the page
        if isinstance(typed, list) and len(typed) == 1:
            typed = typed[0]
        typed = typed if isinstance(typed, str) else ""
        chosen = saved.get(key)
        if isinstance(chosen, list) and len(chosen) == 1:
            chosen = chosen[0]
        if not isinstance(chosen, str) or chosen not in option["choices"]:
            chosen = next((k for k, c in option["choices"].items() if c.get("default")), None)
        rows.append({
            "key": key,
            "display_name": option.get("display_name") or key,
            "choices": [(k, c.get("display_name") or k, k == chosen and not typed)
                        for k, c in option["choices"].items()],
            "unlisted": unlisted if unlisted.get("enabled") else None,
            "typed": typed,
            "other_selected": bool(typed) or not option["choices"],
        })
    return rows


def _describe(a: Allocation) -> str:
    return f"server '{a.holder}'" if a.kind == "notebook" else f"job '{a.holder}'"
