"""The GPU queue's policy: who starts next, from data alone (no database, no clock, no I/O).

`plan` takes one pool's devices, the work running on them, the work waiting and each
person's quota, share and recent usage, and decides one scheduling pass:

- **Order: fair share.** A person's factor is ``2 ** (-U / S)``, Slurm's classic fair-share
  factor: ``U`` their share of everyone's recent GPU-hours (`decayed_usage`: exponential decay
  with a half-life), ``S`` their share of everyone's shares (by default their quota's GPUs, so a
  larger quota buys a larger part; groups may carry shares). Whoever used less of their part
  recently goes first; within one person's work, a higher per-entry priority, then submit
  order. An admin may hold an entry (it waits, with that reason) or move it to the top.
- **Gang admission.** An entry starts whole, on all the GPUs it asks for at once, or not at all.
- **EASY backfill.** The first entry held back only by busy GPUs (the head) gets a
  reservation: the GPUs that come free first and the time they do (running work's start plus
  its ``max_runtime``). Later entries may start ahead of it only where that cannot delay it:
  on GPUs outside the reservation, or on reserved GPUs when their own ``max_runtime`` ends
  before the reservation does. Running work without a time limit makes the reservation's time
  unknown; then nothing backfills onto reserved GPUs. A big job is therefore never starved.
- **Borrowing and preemption.** With borrowing on, preemptible jobs may start beyond their
  person's quota on GPUs nobody waits for. When the head is within its person's quota and
  only borrowed GPUs stand in its way, the youngest borrowed preemptible jobs are stopped for
  it (they go back to the queue and resume from their checkpoints). Notebooks and work within
  quota are never preempted.
- **GPU-hour budgets.** Work of a person past their budget waits, with that reason, instead of
  being refused.

Each waiting entry gets its place in line, an estimated start and the reason it waits, in
words that never name another person. The estimate is the earliest start the rules above allow,
from the time limits of the running work (its start plus its ``max_runtime``) and of the work
ahead in line; it is None where work in the way has no time limit (a notebook: it ends when
its person stops it or the idle culler finds it idle, not at a known time), and the reason
then says which ("start unknown: a notebook using them has no time limit"). An entry waiting
for its person's quota names their own work that holds it ("your job 'digits-3' (2 GPUs, its
time limit ends in about 5 min)"). `refusal_now` is the part that never waits: a request that can never run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from gpulab.hub.quota.policy import Quota, never_fits

INF = math.inf
LN2 = math.log(2.0)


@dataclass(frozen=True)
class Device:
    index: int
    model: str


@dataclass(frozen=True)
class Running:
    """Work holding GPUs: a notebook server or a training job."""

    id: str
    user: str
    kind: str  # notebook | job
    devices: tuple[int, ...]
    started_at: float
    max_runtime: float | None = None  # seconds; None: no limit (the end is unknown)
    preemptible: bool = False
    borrowed: bool = False  # started beyond its person's quota
    stopping: bool = False  # being preempted: its GPUs are coming back
    holder: str = ""  # its name as its person knows it (the job's name, the server's name)

    @property
    def gpus(self) -> int:
        return len(self.devices)

    def end(self, now: float) -> float:
        """When its GPUs come back at the latest (INF when unknown); never before `now`."""
        if self.stopping:
            return now
        if self.max_runtime is None:
            return INF
        return max(now, self.started_at + self.max_runtime)


@dataclass(frozen=True)
class Waiting:
    """An entry of the queue."""

    id: str
    user: str
    kind: str  # notebook | job
    gpus: int
    submitted_at: float
    model: str | None = None  # None: any model
    priority: int = 0  # within one person's work, higher first
    max_runtime: float | None = None
    preemptible: bool = False
    held: bool = False  # an admin holds it
    top: float | None = None  # when an admin moved it to the top (earlier moves first)
    holder: str = ""  # its name as its person knows it


@dataclass(frozen=True)
class Person:
    quota: Quota | None = None
    share: float | None = None  # None: the quota's GPUs (1 without a quota)
    usage: float = 0.0  # decayed GPU-hours (`decayed_usage`)
    budget_used: float = 0.0  # GPU-hours in the quota's window (for `Quota.gpu_hours`)

    def weight(self) -> float:
        if self.share is not None:
            return max(0.0, self.share)
        if self.quota is not None:
            return float(max(self.quota.max_gpus, 0))
        return 1.0


@dataclass(frozen=True)
class Settings:
    borrowing: bool = True


@dataclass(frozen=True)
class Start:
    id: str
    devices: tuple[int, ...]
    borrowed: bool = False


@dataclass(frozen=True)
class Preempt:
    id: str  # a Running's id
    reason: str


@dataclass(frozen=True)
class Place:
    """Where a waiting entry stands after this pass."""

    position: int | None  # 1 = next; None when held by an admin
    estimated_start: float | None  # None: unknown (running work without a time limit)
    reason: str
    ahead: int = 0  # entries ahead of it in line
    ahead_gpus: int = 0  # GPUs those entries ask for


@dataclass
class Plan:
    start: list[Start] = field(default_factory=list)
    preempt: list[Preempt] = field(default_factory=list)
    waiting: dict[str, Place] = field(default_factory=dict)
    #: the ids of waiting entries in the order of the line (held entries last)
    order: list[str] = field(default_factory=list)


def decayed_usage(intervals: Iterable[tuple[str, int, float, float | None]], now: float,
                  half_life: float) -> dict[str, float]:
    """GPU-hours per person, each moment weighted by ``2 ** (-age / half_life)``.

    `intervals` are ``(user, gpus, start, end)`` in seconds since the epoch; ``end`` None means
    still running (until `now`). Exact for constant use over each interval.
    """
    out: dict[str, float] = {}
    if half_life <= 0:
        raise ValueError("half_life must be positive")
    k = LN2 / half_life
    for user, gpus, start, end in intervals:
        end = now if end is None else min(end, now)
        if end <= start or gpus <= 0:
            out.setdefault(user, 0.0)
            continue
        # integral of 2**(-(now - t)/h) dt over [start, end]
        weight = (math.exp(-k * (now - end)) - math.exp(-k * (now - start))) / k
        out[user] = out.get(user, 0.0) + gpus * weight / 3600.0
    return out


def fair_share(people: Mapping[str, Person]) -> dict[str, float]:
    """Each person's factor in (0, 1]: 1 for no recent use, 0.5 when they used exactly their
    share of everyone's use, lower the more they used beyond it."""
    total_usage = sum(max(p.usage, 0.0) for p in people.values())
    total_weight = sum(p.weight() for p in people.values())
    out = {}
    for name, p in people.items():
        s = p.weight() / total_weight if total_weight > 0 else 0.0
        u = max(p.usage, 0.0) / total_usage if total_usage > 0 else 0.0
        if s <= 0:
            out[name] = 0.0 if u > 0 else 2.0 ** -1.0
        else:
            out[name] = 2.0 ** (-u / s)
    return out


def normalize_model(name: str) -> str:
    """Model names as Kubernetes labels spell them (GPU feature discovery replaces spaces).

    ``"NVIDIA H100 80GB HBM3"`` -> ``"NVIDIA-H100-80GB-HBM3"``, so that one profile's
    ``nvidia.com/gpu.product`` selector matches in both modes.
    """
    return "-".join(name.split())


def model_matches(wanted: str | None, model: str) -> bool:
    """Whether a GPU of `model` satisfies a profile asking for `wanted` (None: any model).

    A profile may name the full product (``NVIDIA-H100-80GB-HBM3``) or a prefix of it that
    ends at a word boundary (``NVIDIA-H100``); comparison ignores case.
    """
    if not wanted:
        return True
    w, m = normalize_model(wanted).lower(), normalize_model(model).lower()
    return m == w or m.startswith(w + "-")


def exact_model(wanted: str | None, model: str) -> bool:
    return wanted is None or wanted == model


def refusal_now(gpus: int, model: str | None, quota: Quota | None,
                devices: Iterable[Device], matches: Callable = exact_model,
                borrows: bool = False, can_borrow: bool = False,
                source: str = "none") -> str | None:
    """Why a request can never run (refused at once, not queued), in words; None if it can:
    more GPUs than the machine has, or than the quota ever allows (`never_fits`).
    `borrows`: a preemptible job where borrowing is on, which may go beyond the quota's GPUs
    (not beyond its per-request bound); `can_borrow`: a job that could, marked preemptible."""
    matching = sum(1 for d in devices if matches(model, d.model))
    of = f" of model '{model}'" if model else ""
    if gpus > matching:
        return (f"This request asks for {gpus} GPU{_s(gpus)}{of}; this machine has "
                f"{matching}. Ask for fewer.")
    never = never_fits(quota, gpus, borrows=borrows, can_borrow=can_borrow)
    return never.message(source) if never is not None else None


def _s(n: int) -> str:
    return "" if n == 1 else "s"


def order(queue: Iterable[Waiting], people: Mapping[str, Person]) -> list[Waiting]:
    """The line: moved-to-top entries first, then by fair share, priority, submit order.
    Held entries come last (they do not take part)."""
    factors = fair_share(people)

    def key(w: Waiting):
        return (w.held, w.top is None, w.top if w.top is not None else 0.0,
                -factors.get(w.user, 0.5), -w.priority, w.submitted_at, w.id)

    return sorted(queue, key=key)


def plan(devices: Iterable[Device], running: Iterable[Running], queue: Iterable[Waiting],
         people: Mapping[str, Person], now: float, settings: Settings = Settings(),
         matches: Callable[[str | None, str], bool] = exact_model) -> Plan:
    """One scheduling pass (see the module's docstring). `matches(wanted, model)` says
    whether a device's model is what an entry asks for (default: equal, or any)."""
    devices = sorted(devices, key=lambda d: d.index)
    model_of = {d.index: d.model for d in devices}
    running = list(running)
    holder: dict[int, Running] = {}
    for r in running:
        for i in r.devices:
            holder[i] = r
    # when each device is free at the latest, as the line is walked (now: free)
    free_at = {d.index: (holder[d.index].end(now) if d.index in holder else now) for d in devices}
    # the devices free right now (a device taken in this pass, or being preempted, is not)
    free = {d.index for d in devices if d.index not in holder}
    held_gpus: dict[str, int] = {}
    for r in running:
        held_gpus[r.user] = held_gpus.get(r.user, 0) + r.gpus
    # why a device's `free_at` is unknown (INF): the work on it, or the line ahead of it
    unknown: dict[int, str] = {i: _no_limit(holder[i]) for i, t in free_at.items() if t == INF}
    # one person's own running work: when each of their GPUs comes back
    own_ends: dict[str, list[tuple[float, int, Running]]] = {}
    for r in running:
        own_ends.setdefault(r.user, []).append((r.end(now), r.gpus, r))

    out = Plan()
    line = order(queue, people)
    reserved: set[int] = set()
    reserved_until = None  # the head's start; INF when unknown
    preempting: set[str] = set()
    position = 0
    ahead_gpus = 0

    for w in line:
        out.order.append(w.id)
        if w.held:
            out.waiting[w.id] = Place(None, None, "Held by an admin: it waits until released.")
            continue
        person = people.get(w.user, Person())
        quota = person.quota
        matching = [d.index for d in devices if matches(w.model, model_of[d.index])]
        of = f" of model '{w.model}'" if w.model else ""
        if quota is not None and quota.gpu_hours is not None \
                and person.budget_used >= quota.gpu_hours:
            position += 1
            out.waiting[w.id] = Place(
                position, None,
                f"Waits for GPU-hour budget: {_num(person.budget_used)} of your "
                f"{_num(quota.gpu_hours)} GPU-hours are used in the window; it starts when "
                "usage in the window falls below the budget, or when an admin raises it.",
                position - 1, ahead_gpus)
            ahead_gpus += w.gpus
            continue
        within = quota is None or held_gpus.get(w.user, 0) + w.gpus <= quota.max_gpus
        borrowing = (not within and settings.borrowing and w.preemptible and w.kind == "job")
        if not within and not borrowing:
            position += 1
            mine = held_gpus.get(w.user, 0)
            need = mine + w.gpus - quota.max_gpus
            own, holding = _own_release(own_ends.get(w.user, []), need)
            cap = _kth(sorted(free_at[i] for i in matching), w.gpus)
            est = max(own, cap)
            unknown_why = ""
            if est == INF:
                why = ("your own work holding it has no time limit" if own == INF else
                       _why_unknown(sorted(matching, key=lambda i: (free_at[i], i))[:w.gpus],
                                    free_at, unknown))
                unknown_why = f" (start unknown: {why})"
            out.waiting[w.id] = Place(
                position, None if est == INF else est,
                f"Waits for your quota: {mine} of your {quota.max_gpus} GPU{_s(quota.max_gpus)} "
                f"{'is' if mine == 1 else 'are'} in use{_holding_words(holding, now)}; it starts "
                f"when enough of your own work ends{unknown_why}.", position - 1, ahead_gpus)
            ahead_gpus += w.gpus
            continue

        free_now = [i for i in matching if i in free]
        fits_before = (w.max_runtime is not None and reserved_until is not None
                       and reserved_until != INF and now + w.max_runtime <= reserved_until)
        usable = [i for i in free_now if i not in reserved or fits_before]
        if borrowing:
            # borrowed GPUs: only those nobody in line is promised
            usable = [i for i in usable if i not in reserved]
        if len(usable) >= w.gpus:
            chosen = tuple(sorted(usable, key=lambda i: (i in reserved, i))[:w.gpus])
            out.start.append(Start(w.id, chosen, borrowed=borrowing))
            end = INF if w.max_runtime is None else now + w.max_runtime
            r = Running(w.id, w.user, w.kind, chosen, now, w.max_runtime, w.preemptible,
                        borrowing, holder=w.holder)
            for i in chosen:
                holder[i] = r
                free.discard(i)
                if i not in reserved:  # a reserved GPU goes on to the head afterwards
                    free_at[i] = end
                    if end == INF:
                        unknown[i] = _no_limit(r)
            held_gpus[w.user] = held_gpus.get(w.user, 0) + w.gpus
            own_ends.setdefault(w.user, []).append((end, w.gpus, r))
            continue

        position += 1
        ranked = sorted(matching, key=lambda i: (free_at[i], i))
        if reserved_until is None and not borrowing:
            # the head: reserve the GPUs that come back first, preempting borrowed work if
            # that is what stands in the way of work within quota
            coming = [i for i in matching if i in holder and holder[i].stopping]
            def beyond_quota(user: str) -> bool:  # borrowing still: over their quota now
                q = people.get(user, Person()).quota
                return q is not None and held_gpus.get(user, 0) > q.max_gpus

            victims = _victims(w, matching, free_now + coming, holder, preempting,
                               beyond_quota) if (settings.borrowing and within) else []
            if victims:
                taken = set(free_now) | set(coming)
                for v in victims:
                    preempting.add(v.id)
                    out.preempt.append(Preempt(v.id, (
                        f"Preempted: it ran on {v.gpus} borrowed GPU{_s(v.gpus)} beyond your "
                        f"quota, and work within its owner's quota needed "
                        f"{'it' if v.gpus == 1 else 'them'}. It waits in the queue again and "
                        "resumes from its last checkpoint.")))
                    taken.update(i for i in v.devices if i in matching)
                    for i in v.devices:
                        free_at[i] = now
                reserved = set(sorted(taken)[:w.gpus])
                reserved_until = now
                reason = (f"Starts as soon as {sum(v.gpus for v in victims)} borrowed GPU"
                          f"{_s(sum(v.gpus for v in victims))} "
                          "are handed back (preemptible work beyond its quota is being stopped).")
            else:
                reserved = set(ranked[:w.gpus])
                reserved_until = _kth(sorted(free_at[i] for i in matching), w.gpus)
                reason = _busy_reason(w, len(free_now), len(matching), of, reserved_until,
                                      why=_why_unknown(ranked[:w.gpus], free_at, unknown))
            est = reserved_until
            for i in reserved:
                _take(i, w, est, free_at, unknown)
        else:
            est = _kth(sorted(free_at[i] for i in matching), w.gpus)
            why = _why_unknown(ranked[:w.gpus], free_at, unknown)
            if est != INF:
                for i in ranked[:w.gpus]:
                    _take(i, w, est, free_at, unknown)
            reason = _busy_reason(w, len(free_now), len(matching), of, est, behind=True,
                                  why=why)
        out.waiting[w.id] = Place(position, None if est == INF else est, reason,
                                  position - 1, ahead_gpus)
        ahead_gpus += w.gpus
    return out


def _kth(times: list[float], k: int) -> float:
    """The time when `k` devices are free, from the sorted times each is free."""
    if k <= 0:
        return -INF
    if k > len(times):
        return INF
    return times[k - 1]


def _own_release(ends: list[tuple[float, int, Running]], need: int
                 ) -> tuple[float, list[tuple[float, Running]]]:
    """When a person's own running work has given back `need` GPUs (INF when unknown), and
    the work that must end first, with when each does (soonest first)."""
    if need <= 0:
        return -INF, []
    got, holding = 0, []
    for end, gpus, r in sorted(ends, key=lambda e: (e[0], e[2].id)):
        got += gpus
        holding.append((end, r))
        if got >= need:
            return end, holding
    return INF, holding


def _take(i: int, w: Waiting, start: float, free_at: dict[int, float],
          unknown: dict[int, str]) -> None:
    """Device `i` promised to `w` from `start`: free again at its time limit's end."""
    if start == INF:
        free_at[i] = INF  # `unknown[i]` already says why
    elif w.max_runtime is None:
        free_at[i] = INF
        unknown[i] = f"the {_kind(w.kind)} ahead of it in line has no time limit"
    else:
        free_at[i] = start + w.max_runtime


def _kind(kind: str) -> str:
    return "notebook" if kind == "notebook" else "job"


def _no_limit(r: Running) -> str:
    """Why the end of `r`'s work is unknown, in words that never name another person."""
    if r.kind == "notebook":
        return ("a notebook using them has no time limit: a notebook ends when its person "
                "stops it or when the idle culler finds it idle, not at a known time")
    return "a job using them has no time limit"


def _why_unknown(devices: Iterable[int], free_at: Mapping[int, float],
                 unknown: Mapping[int, str]) -> str:
    """Why the start on `devices` (those an entry would take) is unknown: the first cause."""
    causes = [unknown.get(i, "") for i in devices if free_at[i] == INF]
    causes = [c for c in causes if c]
    if not causes:
        return "the work using them has no time limit"
    return sorted(set(causes), key=causes.index)[0]


def _in(seconds: float) -> str:
    """``in about 5 min``, ``in about 2.5 h``, ``in a moment``."""
    if seconds <= 30:
        return "in a moment"
    if seconds < 3600:
        return f"in about {max(1, round(seconds / 60))} min"
    return f"in about {seconds / 3600:.1f} h"


def _holding_words(holding: list[tuple[float, Running]], now: float) -> str:
    """`` by your job 'digits-3' (2 GPUs, time limit ends in about 5 min)``: the person's own
    work that must end before their entry fits their quota (at most three named)."""
    if not holding:
        return ""
    named = []
    for end, r in holding[:3]:
        what = f"your {_kind(r.kind)}" + (f" '{r.holder}'" if r.holder else "")
        if r.stopping:
            when = "being stopped"
        elif end == INF:
            when = "no time limit" if r.kind == "job" else \
                "no time limit: stop it to free them"
        else:
            when = f"its time limit ends {_in(end - now)}"
        named.append(f"{what} ({r.gpus} GPU{_s(r.gpus)}, {when})")
    more = len(holding) - len(named)
    return " by " + ", ".join(named) + (f" and {more} more" if more > 0 else "")


def _victims(w: Waiting, matching: list[int], free_now: list[int], holder: dict[int, Running],
             preempting: set[str], beyond_quota: Callable[[str], bool]) -> list[Running]:
    """The youngest borrowed preemptible jobs to stop so that `w` fits; [] when stopping all
    of them would not be enough (nothing is stopped in vain). A job that started on borrowed
    GPUs is no longer borrowing once its person holds no more than their quota (their other
    work ended): it is not stopped then."""
    short = w.gpus - len(free_now)
    if short <= 0:
        return []
    seen: dict[str, Running] = {}
    for i in matching:
        r = holder.get(i)
        if r is not None and r.borrowed and r.preemptible and r.kind == "job" \
                and not r.stopping and r.id not in preempting and beyond_quota(r.user):
            seen[r.id] = r
    chosen, got = [], 0
    for r in sorted(seen.values(), key=lambda r: (-r.started_at, r.id)):
        if got >= short:
            break
        chosen.append(r)
        got += sum(1 for i in r.devices if i in matching)
    return chosen if got >= short else []


def _busy_reason(w: Waiting, free: int, total: int, of: str, est: float,
                 behind: bool = False, why: str = "") -> str:
    where = "behind earlier work in line; " if behind else ""
    when = (f"start unknown: {why or 'the work using them has no time limit'}"
            if est == INF else "estimated start from the time limits of the work using them")
    return (f"Waits for {w.gpus} GPU{_s(w.gpus)}{of} at once: {free} of {total} "
            f"{'is' if free == 1 else 'are'} free now ({where}{when}).")


def _num(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".") if x != int(x) else str(int(x))
