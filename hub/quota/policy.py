"""GPU quota policy: what a person may hold, decided from data alone (no database, no I/O).

A `Quota` bounds the GPUs held at once (notebooks and training jobs together), optionally the
GPUs of one request, and optionally GPU-hours over a rolling window; past the budget, new
requests are refused while running work continues. A quota may also bound the person's
disk on the shared storage (``disk``, bytes; see `effective_disk`).

The effective quota of a user is their own override if an admin set one, else the most
generous quota among their groups, else the default, else no limit but the hardware.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

#: limits that keep a typo from becoming a quota (checked on every write)
MAX_GPUS = 4096
MAX_GPU_HOURS = 10_000_000
MAX_WINDOW_HOURS = 24 * 366
#: a disk limit's bounds, bytes: below 32 MiB an ext4 image holds little but its own
#: structures; 1 PiB keeps a typo from becoming a limit
MIN_DISK = 32 * 2**20
MAX_DISK = 2**50
_DISK_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}
_DISK_TEXT = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtp]?)(?:i?b)?\s*", re.IGNORECASE)

SCOPES = ("default", "group", "user")


class QuotaError(ValueError):
    """A quota that cannot be stored; ``field`` names the offending field."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Quota:
    max_gpus: int
    max_per_request: int | None = None
    gpu_hours: float | None = None
    window_hours: int | None = None
    #: the person's disk on the shared storage, bytes (None: this quota sets none)
    disk: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    def generosity(self) -> tuple:
        """Sort key: more GPUs at once first, then a larger budget, then larger requests."""
        inf = math.inf
        return (
            self.max_gpus,
            inf if self.gpu_hours is None else self.gpu_hours,
            inf if self.max_per_request is None else self.max_per_request,
        )

    def describe(self) -> str:
        parts = [f"{self.max_gpus} GPU{'s' if self.max_gpus != 1 else ''} at once"]
        if self.max_per_request is not None:
            parts.append(f"at most {self.max_per_request} per request")
        if self.gpu_hours is not None:
            parts.append(f"{_num(self.gpu_hours)} GPU-hours per {_window(self.window_hours)}")
        if self.disk is not None:
            parts.append(f"{disk_text(self.disk)} disk")
        return ", ".join(parts)


FIELDS = {"max_gpus", "max_per_request", "gpu_hours", "window_hours", "disk"}


def disk_text(size: int) -> str:
    """``64 MiB``, ``20 GiB``, ``1.5 TiB``: a size in bytes in binary units."""
    for unit, factor in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20),
                         ("KiB", 2**10)):
        if size >= factor:
            return f"{_num(round(size / factor, 2))} {unit}"
    return f"{size} bytes"


def disk_input(size: int | None) -> str | None:
    """A disk limit as `parse_disk` reads it back exactly: ``20G``, ``1536M``, or bytes."""
    if size is None:
        return None
    for unit, factor in (("P", 2**50), ("T", 2**40), ("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


def parse_disk(value) -> int | None:
    """A disk limit in bytes from an API value: a whole number of bytes, or a string such as
    ``"20G"``, ``"512MiB"``, ``"1.5T"`` (binary units: K, M, G, T, P, with or without
    ``iB``/``B``); None stays None. `QuotaError` (field ``disk``) for anything else."""
    if value is None:
        return None
    bounds = f"from {disk_text(MIN_DISK)} to {disk_text(MAX_DISK)}"
    if _is_int(value):
        size = value
    elif isinstance(value, str) and (m := _DISK_TEXT.fullmatch(value)):
        size = int(float(m.group(1)) * _DISK_UNITS[m.group(2).lower()])
    else:
        raise QuotaError("disk", "'disk' must be a size such as \"20G\", \"512M\" or a whole "
                         f"number of bytes ({bounds}), or null for none, got {value!r}.")
    if not MIN_DISK <= size <= MAX_DISK:
        raise QuotaError("disk", f"'disk' must be {bounds}, got {value!r}.")
    return size


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def parse_quota(body) -> Quota:
    """A `Quota` from an API body, or `QuotaError` naming the first bad field."""
    if not isinstance(body, dict):
        raise QuotaError("body", "The request body must be a JSON object with the quota's fields.")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise QuotaError(unknown[0], f"Unknown field '{unknown[0]}'. Known fields: "
                         f"{', '.join(sorted(FIELDS))}.")
    if "max_gpus" not in body:
        raise QuotaError("max_gpus", "'max_gpus' is required: the GPUs a person may hold at once.")
    max_gpus = body["max_gpus"]
    if not _is_int(max_gpus) or not 0 <= max_gpus <= MAX_GPUS:
        raise QuotaError("max_gpus", f"'max_gpus' must be a whole number from 0 to {MAX_GPUS}, "
                         f"got {max_gpus!r}.")
    per = body.get("max_per_request")
    if per is not None and (not _is_int(per) or not 1 <= per <= MAX_GPUS):
        raise QuotaError("max_per_request", "'max_per_request' must be a whole number from 1 to "
                         f"{MAX_GPUS}, or null, got {per!r}.")
    hours = body.get("gpu_hours")
    window = body.get("window_hours")
    if hours is not None and (not _is_number(hours) or not 0 <= hours <= MAX_GPU_HOURS):
        raise QuotaError("gpu_hours", "'gpu_hours' must be a number from 0 to "
                         f"{MAX_GPU_HOURS}, or null, got {hours!r}.")
    if window is not None and (not _is_int(window) or not 1 <= window <= MAX_WINDOW_HOURS):
        raise QuotaError("window_hours", "'window_hours' must be a whole number of hours from 1 "
                         f"to {MAX_WINDOW_HOURS}, got {window!r}.")
    if hours is not None and window is None:
        raise QuotaError("window_hours", "'gpu_hours' needs 'window_hours', the length of the "
                         "rolling window (e.g. 168 for 7 days).")
    if window is not None and hours is None:
        raise QuotaError("gpu_hours", "'window_hours' is only meaningful with 'gpu_hours'.")
    return Quota(max_gpus, per, float(hours) if hours is not None else None, window,
                 parse_disk(body.get("disk")))


def effective_quota(
    default: Quota | None,
    groups: dict[str, Quota],
    user: Quota | None,
) -> tuple[Quota | None, str]:
    """The quota that applies and where it comes from (``user``, ``group 'x'``, ``default``).

    `groups` holds the quotas of the user's groups that have one. ``(None, 'none')`` means
    nothing was configured: only the hardware limits the user.
    """
    if user is not None:
        return user, "user"
    if groups:
        name, quota = max(groups.items(), key=lambda item: (item[1].generosity(), item[0]))
        return quota, f"group '{name}'"
    if default is not None:
        return default, "default"
    return None, "none"


def effective_disk(
    default: Quota | None,
    groups: dict[str, Quota],
    user: Quota | None,
) -> tuple[int | None, str]:
    """The disk limit that applies, in bytes, and where it comes from, decided on its own
    (not with the GPUs): the person's own quota's ``disk`` if it sets one, else the largest
    ``disk`` among their groups' quotas, else the default quota's; ``(None, 'none')``: no
    limit."""
    if user is not None and user.disk is not None:
        return user.disk, "user"
    sized = {name: q.disk for name, q in groups.items() if q.disk is not None}
    if sized:
        name, disk = max(sized.items(), key=lambda item: (item[1], item[0]))
        return disk, f"group '{name}'"
    if default is not None and default.disk is not None:
        return default.disk, "default"
    return None, "none"


@dataclass(frozen=True)
class Holding:
    kind: str  # notebook | job
    name: str
    gpus: int

    def describe(self) -> str:
        return f"{self.kind} '{self.name}' ({self.gpus})"


def source_note(source: str) -> str:
    """Where a quota comes from, as the messages say it after "your quota"."""
    return {"user": "", "none": "", "default": " (the default quota)"}.get(source, f" (from {source})")


@dataclass(frozen=True)
class NeverFits:
    """A request that can never run under its quota, whatever its person stops: more GPUs
    than one request may ask (``per_request``), or than the quota allows at once. Refused at
    once everywhere (admission, the queues, Kueue's jobs and notebooks, the spawn form), in
    these words."""

    gpus: int
    limit: int
    per_request: bool
    #: preemptible work could borrow idle GPUs past the quota (said as a way out)
    can_borrow: bool = False

    def message(self, source: str = "none") -> str:
        """The refusal, as the person reads it (``source``: `effective_quota`'s)."""
        where = source_note(source)
        if self.per_request:
            return (f"Quota exceeded: this request asks for {self.gpus} GPUs; your quota{where} "
                    f"allows at most {self.limit} in one request. Ask for fewer, or ask an admin.")
        borrow = ", mark it preemptible to borrow idle GPUs," if self.can_borrow else ""
        return (f"Quota exceeded: this request asks for {self.gpus} GPU{_s(self.gpus)}; your "
                f"quota{where} is {self.limit} GPU{_s(self.limit)} at once. Ask for "
                f"fewer{borrow} or ask an admin for a larger quota.")

    def short(self) -> str:
        """The same, as the spawn form gives the reason a profile cannot start."""
        return (f"more than your quota allows ({self.limit} "
                f"{'in one request' if self.per_request else 'at once'})")


def never_fits(quota: Quota | None, gpus: int, *, borrows: bool = False,
               can_borrow: bool = False) -> NeverFits | None:
    """Why `gpus` GPUs can never run under `quota` (None: they may, once enough is free).
    ``borrows``: preemptible work where borrowing is on, which may go past the quota's GPUs
    at once (not past its bound per request); ``can_borrow``: such work could, so the
    message says so."""
    if quota is None or gpus <= 0:
        return None
    if quota.max_per_request is not None and gpus > quota.max_per_request:
        return NeverFits(gpus, quota.max_per_request, per_request=True)
    if gpus > quota.max_gpus and not borrows:
        return NeverFits(gpus, quota.max_gpus, per_request=False, can_borrow=can_borrow)
    return None


def _s(n: int) -> str:
    return "" if n == 1 else "s"


def refusal(
    quota: Quota | None,
    source: str,
    requested: int,
    holdings: list[Holding],
    used_gpu_hours: float = 0.0,
) -> str | None:
    """Why `requested` more GPUs are refused under `quota`, in words; None when allowed."""
    if quota is None or requested <= 0:
        return None
    where = source_note(source)
    never = never_fits(quota, requested)
    if never is not None:
        return never.message(source)
    held = sum(h.gpus for h in holdings)
    if held + requested > quota.max_gpus:
        plural = "s" if quota.max_gpus != 1 else ""
        what = ", ".join(h.describe() for h in holdings)
        return (
            f"Quota exceeded: this request needs {requested} GPU{'s' if requested != 1 else ''} "
            f"and {held} of your {quota.max_gpus} GPU{plural}{where} "
            f"{'is' if held == 1 else 'are'} in use: {what}. "
            "Stop one of them, ask for fewer GPUs, or ask an admin for a larger quota."
        )
    if quota.gpu_hours is not None and used_gpu_hours >= quota.gpu_hours:
        return (
            f"GPU-hour budget used up: {_num(used_gpu_hours)} of your {_num(quota.gpu_hours)} "
            f"GPU-hours{where} over the last {_window(quota.window_hours)}. Running work "
            "continues; new requests are accepted again once usage in the window falls below "
            "the budget, or when an admin raises it."
        )
    return None


def _num(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".") if x != int(x) else str(int(x))


def _window(hours: int | None) -> str:
    if not hours:
        return "window"
    if hours % 24 == 0:
        days = hours // 24
        return f"{days} day{'s' if days != 1 else ''}"
    return f"{hours} hour{'s' if hours != 1 else ''}"
