"""GPU profiles in KubeSpawner's ``profile_list`` shape, so one list serves both modes.

A profile is a KubeSpawner profile (z2jh ``singleuser.profileList`` entry)::

    {
        "display_name": "2 GPUs (H100)",
        "slug": "gpu-2",                       # optional, derived from display_name
        "description": "For multi-GPU work",
        "default": True,
        "kubespawner_override": {
            "extra_resource_limits": {"nvidia.com/gpu": "2"},
            "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100"},
            "cpu_limit": 8,
            "mem_limit": "32G",
        },
    }

The GPU count is the ``nvidia.com/gpu`` resource limit and the GPU model the
``nvidia.com/gpu.product`` node selector. Override keys are KubeSpawner trait names
(``node_selector``, not ``nodeSelector``): a misspelt key is a configuration error.

KubeSpawner's ``profile_options`` work as in KubeSpawner 7: each option offers ``choices``
(one of them the default, else the first) and may accept an ``unlisted_choice`` (free text,
checked against its ``validation_regex`` with ``re.match``, put into its
``kubespawner_override`` strings as ``{value}``). The overrides apply in KubeSpawner's order:
the configured traits, the profile's ``kubespawner_override``, then each option's choice in
the order the options are listed; a dictionary trait is merged, a ``None`` value removes a key.
The GPUs are counted from the final ``extra_resource_limits``: a choice may change them.

``user_options`` have KubeSpawner's shape: ``{"profile": <slug>, <option>: <choice>}`` or
``{"profile": <slug>, "<option>--unlisted-choice": <text>}``; the spawn form's fields are
``profile`` and ``profile-option-<slug>--<option>`` (``...--unlisted-choice``).

gpulab adds ``allowed_groups`` to a profile: a list of group names; only members of one of
them see the profile or may start it (absent: everyone).
"""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import dataclass, field

from gpulab.hub.cluster.kubeobjects import GPU_MODEL_LABEL, GPU_RESOURCE

# Override keys that LocalGPUSpawner applies; every other KubeSpawner trait is accepted and
# only used in Kubernetes mode.
LOCAL_OVERRIDES = {
    "extra_resource_limits",
    "extra_resource_guarantees",
    "node_selector",
    "cpu_limit",
    "cpu_guarantee",
    "mem_limit",
    "mem_guarantee",
    "environment",
    "default_url",
    "cmd",
    "args",
}

#: ``user_options`` key of an option's free-text value, after the option's own key
UNLISTED_SUFFIX = "--unlisted-choice"
#: form fields of a profile's options start so (KubeSpawner's names)
OPTION_FIELD_PREFIX = "profile-option-"


class ProfileError(ValueError):
    """A profile list that cannot be used; the message names the profile and the key."""


class OptionError(ValueError):
    """``user_options`` that name no usable profile or choice; the message is for the person."""


@dataclass(frozen=True)
class GPUProfile:
    slug: str
    display_name: str
    description: str
    gpus: int
    model: str | None
    cpu_limit: float | None
    mem_limit: str | None
    default: bool
    override: dict = field(default_factory=dict, compare=False, hash=False)
    #: KubeSpawner's ``profile_options``, initialised (a default choice, ``unlisted_choice``)
    options: dict = field(default_factory=dict, compare=False, hash=False)
    #: group names allowed to use the profile; None: everyone
    allowed_groups: tuple[str, ...] | None = None

    def allows(self, groups) -> bool:
        return self.allowed_groups is None or bool(set(groups) & set(self.allowed_groups))

    @property
    def summary(self) -> str:
        """E.g. "2 GPUs (NVIDIA-H100), 8 CPUs, 32G memory" or "no GPU"."""
        parts = []
        if self.gpus:
            parts.append(
                f"{self.gpus} GPU{'s' if self.gpus != 1 else ''}"
                + (f" ({self.model})" if self.model else "")
            )
        else:
            parts.append("no GPU")
        if self.cpu_limit:
            cpus = f"{self.cpu_limit:g}"
            parts.append(f"{cpus} CPU{'s' if cpus != '1' else ''}")
        if self.mem_limit:
            parts.append(f"{self.mem_limit} memory")
        return ", ".join(parts)


def slugify(name: str) -> str:
    """A slug like KubeSpawner's: lower case, runs of other characters become one dash."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "profile"


@functools.lru_cache(maxsize=1)
def _kubespawner_traits() -> frozenset[str]:
    """KubeSpawner's trait names. Importing kubespawner (its Kubernetes client) costs a
    process about 40 MiB, so callers ask only for keys that are not local ones."""
    try:
        from kubespawner import KubeSpawner
    except ImportError:  # pragma: no cover - kubespawner is a dependency
        return frozenset(LOCAL_OVERRIDES)
    return frozenset(KubeSpawner.class_trait_names())


def _gpu_count(value, where: str) -> int:
    if value is None:
        return 0
    try:
        text = str(value).strip()
        if not re.fullmatch(r"\d+", text):
            raise ValueError
        return int(text)
    except (TypeError, ValueError):
        raise ProfileError(
            f"{where}: the {GPU_RESOURCE} limit must be a whole number >= 0, got {value!r}."
        ) from None


def _check_override(override, where: str, known_traits) -> dict:
    if override is None:
        return {}
    if not isinstance(override, dict):
        raise ProfileError(f"{where}: 'kubespawner_override' must be a mapping.")
    unknown = sorted(k for k in override if k not in LOCAL_OVERRIDES)
    if unknown:  # other KubeSpawner traits (an image, volumes…): a profile list for both modes
        known = known_traits if known_traits is not None else _kubespawner_traits()
        unknown = [k for k in unknown if k not in known]
    if unknown:
        raise ProfileError(
            f"{where}: unknown kubespawner_override key(s) {', '.join(unknown)} "
            "(keys are KubeSpawner trait names, e.g. node_selector, extra_resource_limits)."
        )
    return override


def _init_options(raw, where: str, known_traits) -> dict:
    """KubeSpawner's ``profile_options``, checked, with its defaults filled in (a copy)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ProfileError(f"{where}: 'profile_options' must be a mapping of option names.")
    options = {}
    for key, option in raw.items():
        here = f"{where}, option {key!r}"
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", key) \
                or key.endswith(UNLISTED_SUFFIX) or key == "profile":
            raise ProfileError(f"{here}: option names are letters, digits, '.', '_' and '-'.")
        if not isinstance(option, dict):
            raise ProfileError(f"{here}: an option must be a mapping.")
        option = copy.deepcopy(option)
        choices = option.get("choices") or {}
        if not isinstance(choices, dict):
            raise ProfileError(f"{here}: 'choices' must be a mapping of choice names.")
        for name, choice in choices.items():
            if not isinstance(choice, dict):
                raise ProfileError(f"{here}, choice {name!r}: a choice must be a mapping.")
            _check_override(choice.get("kubespawner_override"), f"{here}, choice {name!r}",
                            known_traits)
        if choices and not any(c.get("default") for c in choices.values()):
            next(iter(choices.values()))["default"] = True  # the first, as KubeSpawner does
        option["choices"] = choices
        unlisted = option.get("unlisted_choice")
        if unlisted is None:
            unlisted = {}
        if not isinstance(unlisted, dict):
            raise ProfileError(f"{here}: 'unlisted_choice' must be a mapping.")
        unlisted.setdefault("enabled", False)
        if unlisted["enabled"]:
            unlisted.setdefault("display_name_in_choices", "Other...")
            unlisted.setdefault("display_name", option.get("display_name") or key)
            regex = unlisted.get("validation_regex")
            if regex:
                try:
                    re.compile(regex)
                except re.error as e:
                    raise ProfileError(f"{here}: validation_regex {regex!r}: {e}.") from None
            _check_override(unlisted.get("kubespawner_override"), f"{here}, unlisted_choice",
                            known_traits)
        elif not choices:
            raise ProfileError(f"{here}: an option needs 'choices' or an enabled "
                               "'unlisted_choice'.")
        option["unlisted_choice"] = unlisted
        option.setdefault("display_name", key)
        options[key] = option
    return options


def parse_profile(entry: dict, position: int, known_traits: set[str] | None = None) -> GPUProfile:
    where = f"profile_list[{position}]"
    if not isinstance(entry, dict):
        raise ProfileError(f"{where}: a profile must be a mapping, got {type(entry).__name__}.")
    name = entry.get("display_name")
    if not isinstance(name, str) or not name.strip():
        raise ProfileError(f"{where}: 'display_name' is required.")
    where = f"profile {name!r}"
    slug = entry.get("slug") or slugify(name)
    if not re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", slug):
        raise ProfileError(f"{where}: slug {slug!r} must be lower-case letters, digits and dashes.")
    override = _check_override(entry.get("kubespawner_override"), where, known_traits)
    options = _init_options(entry.get("profile_options"), where, known_traits)
    groups = entry.get("allowed_groups")
    if groups is not None:
        if isinstance(groups, str) or not all(isinstance(g, str) for g in groups):
            raise ProfileError(f"{where}: 'allowed_groups' must be a list of group names.")
        groups = tuple(groups)
    # what the form shows: the profile with each option's default choice
    shown = merge_overrides({}, [override, *(default_choice_override(o) for o in options.values())],
                            evaluate=None)
    gpus, model = gpu_request(shown, where)
    cpu = shown.get("cpu_limit")
    if cpu is not None:
        try:
            cpu = float(cpu)
        except (TypeError, ValueError):
            raise ProfileError(f"{where}: cpu_limit must be a number, got {cpu!r}.") from None
        if cpu <= 0:
            raise ProfileError(f"{where}: cpu_limit must be > 0, got {cpu!r}.")
    mem = shown.get("mem_limit")
    return GPUProfile(
        slug=slug,
        display_name=name.strip(),
        description=str(entry.get("description") or ""),
        gpus=gpus,
        model=model if isinstance(model, str) else None,
        cpu_limit=cpu,
        mem_limit=str(mem) if mem is not None else None,
        default=bool(entry.get("default")),
        override=dict(override),
        options=options,
        allowed_groups=groups,
    )


def parse_profiles(profile_list: list | dict) -> list[GPUProfile]:
    """Validate a whole profile list; raises `ProfileError` naming the first bad entry.

    A mapping (KubeSpawner's other shape) is taken in the order of its sorted keys."""
    if isinstance(profile_list, dict):
        profile_list = [profile_list[k] for k in sorted(profile_list)]
    if not isinstance(profile_list, list):
        raise ProfileError("profile_list must be a list of profiles.")
    profiles = [parse_profile(p, i) for i, p in enumerate(profile_list)]
    seen: set[str] = set()
    for p in profiles:
        if p.slug in seen:
            raise ProfileError(f"Two profiles have the slug {p.slug!r}; slugs must be unique.")
        seen.add(p.slug)
    if sum(p.default for p in profiles) > 1:
        raise ProfileError("More than one profile is marked default.")
    return profiles


def default_profile_list(total_gpus: int) -> list[dict]:
    """The profiles offered when none are configured: CPU only, then 1, 2, 4, 8 GPUs."""
    profiles = [
        {
            "display_name": "CPU only",
            "slug": "cpu",
            "description": "A server without GPUs, for editing and small jobs.",
        }
    ]
    for n in (1, 2, 4, 8):
        if n <= total_gpus:
            profiles.append(
                {
                    "display_name": f"{n} GPU" + ("s" if n > 1 else ""),
                    "slug": f"gpu-{n}",
                    "kubespawner_override": {"extra_resource_limits": {GPU_RESOURCE: str(n)}},
                    **({"default": True} if n == 1 else {}),
                }
            )
    if total_gpus == 0:
        profiles[0]["default"] = True
    return profiles


def choose_profile(profiles: list[GPUProfile], slug: str | None) -> GPUProfile:
    """The profile named by `slug`, or the default (first) one when `slug` is None."""
    if not profiles:
        raise ProfileError("No profiles are configured.")
    if slug is None:
        return next((p for p in profiles if p.default), profiles[0])
    for p in profiles:
        if p.slug == slug:
            return p
    raise LookupError(slug)


# -- the overrides a server gets --------------------------------------------------------------


def default_choice_override(option: dict) -> dict:
    """The ``kubespawner_override`` of an (initialised) option's default choice ({} if none)."""
    for choice in option.get("choices", {}).values():
        if choice.get("default"):
            return choice.get("kubespawner_override") or {}
    return {}


class _KeepMissing(dict):
    def __missing__(self, key):
        return "{" + key + "}"


def format_value(template, value: str):
    """``template`` with ``{value}`` replaced in every string inside it (other ``{name}``
    fields are left as they are), as KubeSpawner formats an unlisted choice's overrides."""
    if isinstance(template, str):
        return template.format_map(_KeepMissing(value=value))
    if isinstance(template, list):
        return [format_value(v, value) for v in template]
    if isinstance(template, set):
        return {format_value(v, value) for v in template}
    if isinstance(template, dict):
        return {format_value(k, value): format_value(v, value) for k, v in template.items()}
    return template


def merge_overrides(base: dict, overrides, evaluate=None) -> dict:
    """``base`` (trait name -> value) with each of ``overrides`` applied in turn, as
    KubeSpawner applies them: a mapping over a mapping is merged (recursively; a ``None``
    value removes the key), anything else replaces. A callable value is called with
    ``evaluate`` (the spawner) first; with ``evaluate=None`` it stays as it is. Pure: ``base``
    is not changed."""
    out = copy.deepcopy(base)
    for override in overrides:
        for key, value in (override or {}).items():
            if callable(value) and evaluate is not None:
                value = value(evaluate)
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = _merged(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
    return out


def _merged(old: dict, new: dict) -> dict:
    out = dict(old)
    for k, v in new.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merged(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def gpu_request(traits: dict, where: str = "the server") -> tuple[int, str | None]:
    """(GPU count, GPU model) from final trait values (``extra_resource_limits``,
    ``node_selector``); a value still a callable counts as 0 here (it is known at start)."""
    limits = traits.get("extra_resource_limits") or {}
    count = limits.get(GPU_RESOURCE, 0) if isinstance(limits, dict) else 0
    gpus = 0 if callable(count) else _gpu_count(count, where)
    selector = traits.get("node_selector") or {}
    model = selector.get(GPU_MODEL_LABEL) if isinstance(selector, dict) else None
    return gpus, (model if isinstance(model, str) and model else None)


@dataclass(frozen=True)
class Selection:
    """What ``user_options`` chose: a profile, a value per option, the overrides in order."""

    profile: GPUProfile
    #: option -> the choice's key, or ``(unlisted text,)`` for an unlisted choice
    choices: dict
    #: the profile's override, then each option's (unlisted ones formatted), in order
    overrides: tuple

    @property
    def override_keys(self) -> set[str]:
        return {k for o in self.overrides for k in o}


def visible_profiles(profiles: list[GPUProfile], groups) -> list[GPUProfile]:
    """The profiles a member of ``groups`` may see and use; the first is the default when the
    configured default is not among them."""
    return [p for p in profiles if p.allows(groups)]


#: the longest text a person may type for an option (an unlisted choice): checked before the
#: operator's `validation_regex` runs on it, so that a regex with heavy backtracking meets
#: short input only, and refusals never echo megabytes into the hub's log
MAX_OPTION_TEXT = 256


def is_plain_number(text: str) -> bool:
    """Digits 0-9 only: ``str.isdigit`` also accepts others ("²", "٥") that ``int`` refuses
    or reads as another number."""
    return text.isascii() and text.isdigit()


def _short(value, limit: int = 80) -> str:
    """`value`'s repr for a message, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _one(value, what: str, kind: str = "a choice's name or text"):
    """A value from the API or a passthrough form: a string (at most `MAX_OPTION_TEXT`
    characters), or a list of exactly one."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if value is not None and not isinstance(value, str):
        raise OptionError(f"{what} must be {kind}, got {_short(value)}.")
    if value is not None and len(value) > MAX_OPTION_TEXT:
        raise OptionError(f"{what} must be at most {MAX_OPTION_TEXT} characters, got "
                          f"{len(value)}.")
    return value


def select(profiles: list[GPUProfile], options: dict, *, groups=(), strict: bool = True,
           extra_keys=()) -> Selection:
    """Check ``user_options`` (KubeSpawner's shape) against the profiles a member of
    ``groups`` may use; raises `OptionError` with a message for the person.

    ``strict``: any key that is not the profile's or its options' is refused (the spawn form
    and the API of a hub whose options are gpulab's); otherwise such keys are left to the
    operator's own hooks (their ``options_from_form`` / ``apply_user_options``).
    ``extra_keys``: keys of the spawner's own besides the profiles' (LocalGPUSpawner's
    ``gpu_wait_minutes``), known in strict mode too; the spawner checks their values."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise OptionError("Server options must be a JSON object.")
    mine = visible_profiles(profiles, groups)
    names = ", ".join(p.slug for p in mine)
    slug = _one(options.get("profile"), "'profile'", "a profile name") if "profile" in options else None
    if not mine:
        raise OptionError("No profile is available to you; ask the hub's admin.")
    if not slug:
        profile = next((p for p in mine if p.default), mine[0])
    else:
        profile = next((p for p in mine if p.slug == slug), None)
        if profile is None:  # a profile of other groups is not named to others
            raise OptionError(f"There is no profile {_short(slug)}. Choose one of: {names}.")
    known = {"profile", *extra_keys}
    for key in profile.options:
        known |= {key, key + UNLISTED_SUFFIX}
    if strict:
        unknown = sorted(k for k in options if k not in known)
        if unknown:
            hint = f"'profile': one of {names}"
            if profile.options:
                hint += f"; for profile {profile.slug!r}: " + ", ".join(
                    repr(k) for k in profile.options)
            raise OptionError(f"Unknown server option(s): "
                              f"{', '.join(k if len(k) <= 40 else k[:39] + '…' for k in map(str, unknown[:10]))}"
                              f"{' and more' if len(unknown) > 10 else ''}. "
                              f"Choose a profile ({hint}).")
    chosen: dict = {}
    overrides = [profile.override]
    for key, option in profile.options.items():
        label = option.get("display_name") or key
        unlisted = _one(options.get(key + UNLISTED_SUFFIX), f"{label!r}")
        choice = _one(options.get(key), f"{label!r}")
        spec = option["unlisted_choice"]
        if unlisted:
            if not spec.get("enabled"):
                raise OptionError(f"{label!r} of profile {profile.slug!r} takes only one of: "
                                  f"{', '.join(option['choices'])}.")
            regex = spec.get("validation_regex")
            if regex and not re.match(regex, unlisted):
                why = spec.get("validation_message") or f"it must match {regex}"
                raise OptionError(f"{_short(unlisted)} is not allowed for {label!r}: {why}.")
            chosen[key] = (unlisted,)
            overrides.append(format_value(spec.get("kubespawner_override") or {}, unlisted))
        elif choice:
            if choice not in option["choices"]:
                raise OptionError(f"{label!r} of profile {profile.slug!r} has no choice "
                                  f"{_short(choice)}. Choose one of: {', '.join(option['choices'])}.")
            chosen[key] = choice
            overrides.append(option["choices"][choice].get("kubespawner_override") or {})
        else:
            default = next((k for k, c in option["choices"].items() if c.get("default")), None)
            if default is None:  # only an unlisted choice, and nothing typed into it
                raise OptionError(f"Enter a value for {label!r} of profile {profile.slug!r}.")
            chosen[key] = default
            overrides.append(option["choices"][default].get("kubespawner_override") or {})
    return Selection(profile=profile, choices=chosen, overrides=tuple(overrides))


def options_from_formdata(formdata: dict) -> tuple[dict, list[str]]:
    """KubeSpawner's reading of the spawn form: ``profile`` and the chosen profile's
    ``profile-option-<slug>--<option>`` fields as ``user_options``; and the names of the
    other fields (``_xsrf`` aside)."""
    values = formdata.get("profile") or []
    slug = values[0] if values else None
    options: dict = {}
    if slug:
        options["profile"] = slug
    prefix = f"{OPTION_FIELD_PREFIX}{slug}--"
    other = []
    for key, value in formdata.items():
        if key in ("profile", "_xsrf"):
            continue
        if slug and key.startswith(prefix) and value:
            options[key[len(prefix):]] = value[0]
        elif not key.startswith(OPTION_FIELD_PREFIX):
            other.append(key)
    return options, sorted(other)
