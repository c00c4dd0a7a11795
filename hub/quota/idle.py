"""GPU-idle culling's settings and policy (``c.GPUIdle``): which servers and jobs that hold
idle GPUs are warned, then stopped.

Kernel-idle is not GPU-idle: a kernel that finished training an hour ago still holds its GPU
until JupyterHub's idle culler ends it, and one whose loop hangs is never idle. The gpulab
service therefore watches the GPUs themselves (`gpulab.hub.machine.gpuusage`): a server or
a job whose every GPU stayed below `GPUIdle.threshold_percent` for `GPUIdle.idle_seconds` is
warned (on the hub's My GPUs page, in the audit trail) and, in ``stop`` mode, stopped
`GPUIdle.warn_seconds` later if still idle, its GPUs given back. A person keeps a server
that is only thinking with "keep for N hours" (at most `GPUIdle.keep_max_hours`).

`IdleTracker` is the policy as a pure state machine (time passed in): the service feeds it
each holding's figures every sampling round and acts on what it answers
(`gpulab.hub.service.idle`). Nothing here does I/O.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

from traitlets import CaselessStrEnum, Dict, Float, List
from traitlets.config import SingletonConfigurable

MODES = ("off", "warn", "stop")


@dataclass(frozen=True)
class IdleRule:
    """How idle GPUs of one kind of holding are treated."""

    mode: str = "off"
    threshold_percent: float = 5.0
    idle_seconds: float = 3600.0
    warn_seconds: float = 600.0
    #: which holdings the rule is for (empty: all): hub groups, profile slugs, kinds
    groups: tuple[str, ...] = ()
    profiles: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()

    def matches(self, kind: str, groups, profile: str | None) -> bool:
        return ((not self.kinds or kind in self.kinds)
                and (not self.groups or bool(set(groups) & set(self.groups)))
                and (not self.profiles or (profile or "") in self.profiles))


class BadIdleRule(ValueError):
    pass


def make_rule(base: IdleRule, raw: dict) -> IdleRule:
    """A rule of `GPUIdle.rules`: `base` (the defaults) with the keys `raw` sets."""
    if not isinstance(raw, dict):
        raise BadIdleRule(f"c.GPUIdle.rules: each rule is a dict, not {raw!r}")
    known = {f for f in IdleRule.__dataclass_fields__}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise BadIdleRule(f"c.GPUIdle.rules: unknown key(s) {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(known))}")
    values = dict(raw)
    for key in ("groups", "profiles", "kinds"):
        if key in values:
            values[key] = tuple(str(x) for x in values[key])
    for key in ("threshold_percent", "idle_seconds", "warn_seconds"):
        if key in values:
            values[key] = float(values[key])
    rule = replace(base, **values)
    if rule.mode not in MODES:
        raise BadIdleRule(f"c.GPUIdle.rules: mode must be one of {', '.join(MODES)}, "
                          f"not {rule.mode!r}")
    if rule.idle_seconds <= 0 or rule.warn_seconds < 0 or not 0 <= rule.threshold_percent <= 100:
        raise BadIdleRule("c.GPUIdle.rules: idle_seconds > 0, warn_seconds >= 0 and "
                          "0 <= threshold_percent <= 100")
    return rule


@dataclass(frozen=True)
class IdleSettings:
    default: IdleRule = IdleRule()
    rules: tuple[IdleRule, ...] = ()
    keep_max_hours: float = 8.0

    def rule_for(self, kind: str, groups=(), profile: str | None = None) -> IdleRule:
        """The first rule that matches a holding, else the default."""
        for r in self.rules:
            if r.matches(kind, groups, profile):
                return r
        return self.default

    @property
    def active(self) -> bool:
        return self.default.mode != "off" or any(r.mode != "off" for r in self.rules)

    def to_json(self) -> str:
        return json.dumps({"default": asdict(self.default),
                           "rules": [asdict(r) for r in self.rules],
                           "keep_max_hours": self.keep_max_hours}, sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | None) -> "IdleSettings":
        if not raw:
            return cls()
        d = json.loads(raw)
        base = make_rule(IdleRule(), d.get("default", {}))
        return cls(base, tuple(make_rule(base, {k: v for k, v in r.items()})
                               for r in d.get("rules", [])),
                   float(d.get("keep_max_hours", 8.0)))


class GPUIdle(SingletonConfigurable):
    """GPU-idle culling: servers and jobs whose GPUs sit idle are warned, then stopped."""

    mode = CaselessStrEnum(
        list(MODES), default_value="off",
        help="""What happens to a server or training job whose every GPU stayed below
        `threshold_percent` for `idle_seconds` (the default rule; `rules` may say otherwise
        for some groups, profiles or kinds):

        - ``off`` (default): nothing.
        - ``warn``: its owner is warned (the hub's My GPUs page, the audit trail, the log).
        - ``stop``: warned `warn_seconds` before, then stopped and its GPUs given back, with
          the reason in the audit trail and on My GPUs.

        GPUs are read every ``c.GPUInventory.usage_interval`` seconds from
        ``c.GPUInventory.usage_source``; a holding whose GPUs are not measured (simulated
        GPUs without the stand-in source, a node DCGM does not cover) is never culled.
        Example: ``c.GPUIdle.mode = "stop"``
        """).tag(config=True)

    threshold_percent = Float(
        5.0, min=0, max=100,
        help="""Utilisation (percent of the sample period a kernel ran) below which a GPU
        counts as idle (default 5). Example: ``c.GPUIdle.threshold_percent = 10``""",
    ).tag(config=True)

    idle_seconds = Float(
        3600.0, min=0,
        help="""How long, in seconds, every GPU of a holding must stay below the threshold
        before it is stopped (``stop``) or its owner warned (``warn``); default 3600.
        Example: ``c.GPUIdle.idle_seconds = 2 * 3600``""",
    ).tag(config=True)

    warn_seconds = Float(
        600.0, min=0,
        help="""In ``stop`` mode, how long before the stop the owner is warned (default 600);
        the stop never comes sooner than this after the warning.
        Example: ``c.GPUIdle.warn_seconds = 900``""",
    ).tag(config=True)

    keep_max_hours = Float(
        8.0, min=0,
        help="""The longest "keep for N hours" a person may ask for a server (API
        ``POST /services/gpulab/api/v1/servers/<name>/keep``, the My GPUs button, ``gpulab
        keep``); a longer one is refused with 400. 0: nobody may keep a server (default 8).
        Example: ``c.GPUIdle.keep_max_hours = 4``""",
    ).tag(config=True)

    rules = List(
        Dict(), default_value=[],
        help="""Rules for some holdings, the first that matches wins, else the settings above.
        Each is a dict with any of ``groups`` (hub groups, one of which the owner is in),
        ``profiles`` (profile slugs of servers), ``kinds`` (``notebook``, ``job``) to say
        which holdings it is for, and ``mode``, ``threshold_percent``, ``idle_seconds``,
        ``warn_seconds`` (the rest from the settings above). Example::

            c.GPUIdle.rules = [
                {"groups": ["interactive"], "mode": "warn"},
                {"kinds": ["job"], "mode": "stop", "idle_seconds": 1800},
            ]
        """,
    ).tag(config=True)

    def settings(self) -> IdleSettings:
        base = make_rule(IdleRule(), {"mode": self.mode.lower(),
                                      "threshold_percent": self.threshold_percent,
                                      "idle_seconds": self.idle_seconds or 1.0,
                                      "warn_seconds": self.warn_seconds})
        return IdleSettings(base, tuple(make_rule(base, r) for r in self.rules),
                            float(self.keep_max_hours))

    def settings_json(self) -> str:
        """These settings as JSON, for the gpulab service (`IdleSettings.from_json`)."""
        return self.settings().to_json()


@dataclass
class _State:
    idle_since: float | None = None
    warned_at: float | None = None
    keep_until: float | None = None


@dataclass(frozen=True)
class Action:
    """What the service should do about one holding: ``warn`` or ``stop``."""

    what: str
    idle_since: float
    stop_at: float | None
    rule: IdleRule


@dataclass
class IdleTracker:
    """The policy over time, per allocation id (pure: the caller passes the time)."""

    states: dict[str, _State] = field(default_factory=dict)

    def observe(self, alloc_id: str, busy: bool | None, rule: IdleRule, now: float) -> Action | None:
        """One round's verdict on a holding: `busy` True (a GPU at or over the threshold),
        False (every GPU below it) or None (not measured: never culled, its clock reset)."""
        st = self.states.setdefault(alloc_id, _State())
        if busy is not False or rule.mode == "off":
            st.idle_since = st.warned_at = None
            return None
        if st.keep_until is not None:
            if now < st.keep_until:
                st.idle_since = st.warned_at = None
                return None
            st.keep_until = None
        if st.idle_since is None:
            st.idle_since = now
        idle_for = now - st.idle_since
        if rule.mode == "warn":
            if idle_for >= rule.idle_seconds and st.warned_at is None:
                st.warned_at = now
                return Action("warn", st.idle_since, None, rule)
            return None
        warn_at = max(0.0, rule.idle_seconds - rule.warn_seconds)
        if st.warned_at is None:
            if idle_for >= warn_at:
                st.warned_at = now
                return Action("warn", st.idle_since, self.stop_at(alloc_id, rule), rule)
            return None
        if now >= self.stop_at(alloc_id, rule):
            return Action("stop", st.idle_since, now, rule)
        return None

    def stop_at(self, alloc_id: str, rule: IdleRule) -> float | None:
        st = self.states.get(alloc_id)
        if st is None or st.idle_since is None or rule.mode != "stop":
            return None
        at = st.idle_since + rule.idle_seconds
        if st.warned_at is not None:
            at = max(at, st.warned_at + rule.warn_seconds)
        return at

    def keep(self, alloc_id: str, until: float) -> None:
        st = self.states.setdefault(alloc_id, _State())
        st.keep_until, st.idle_since, st.warned_at = until, None, None

    def state(self, alloc_id: str) -> _State | None:
        return self.states.get(alloc_id)

    def forget_except(self, alive) -> None:
        for k in set(self.states) - set(alive):
            del self.states[k]
