"""The soak's report, pure: what a soak run's launcher log, metrics records and /proc samples say, against the
failure-free run of the same config (``scripts/soak.sh``, :mod:`ntp_megatron.bench.soak`).

Nothing lost: every failure injected is accounted for — absorbed (its rank's ``rank_failed`` event, and the job went
on: a ``reformed`` event after it, or the run finished), pending at the end (armed, the run ended before its phase
came), or lost (listed). Nothing leaked: no process of the job left after it, and each process's threads and fds in
the last generation it lived in back at its first generation's. Loss equal: every iteration's lm loss within
:data:`LOSS_TOL` of the failure-free run's.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Optional, Sequence

LOSS_TOL = 1e-5
"""Relative difference of lm loss per iteration allowed against the failure-free run: the tolerance of the kill
runs in ``tests/jobs/live/test_live_failure.py`` (``TOL``, with ``relative_difference`` of
``tests/harness/checks.py``: |a - b| / max(|a|, |b|, 1e-12))."""

_ARMED = re.compile(r"ntp-launch: arming (\w+) at phase (\w+) in launch rank (\d+) \(pid (\d+)\)")
_OUTSIDE = re.compile(r"ntp-launch: injecting (\w+) of launch rank (\d+) \(pid (\d+)\) from outside")
_FIRED = re.compile(r"\[rank (\d+)\]\s+injected failure: (\w+):rank=\d+,iter=(\d+)(?:,phase=(\w+))?")
_SLOWED = re.compile(r"\[rank (\d+)\]\s+injected slowdown: ")


@dataclass
class Injection:
    """One failure the launcher injected: armed in a rank (fires at ``phase``) or done from outside."""

    kind: str
    rank: int
    pid: int
    phase: str
    fired: bool = False
    outcome: str = "pending"
    """``absorbed``, ``lost`` or ``pending`` (armed, never fired: the run ended first)."""


def injections(log: str) -> list[Injection]:
    """Every failure the launcher's log says it injected, in order, each marked fired when its rank said so (a rank's
    lines keep their order: its n-th fired failure of a kind and phase is its n-th armed one)."""
    out: list[Injection] = []
    for line in log.splitlines():
        m = _ARMED.search(line)
        if m:
            out.append(Injection(m[1], int(m[3]), int(m[4]), m[2]))
            continue
        m = _OUTSIDE.search(line)
        if m:
            out.append(Injection(m[1], int(m[2]), int(m[3]), "outside", fired=True))
            continue
        m = _FIRED.search(line) or _SLOWED.search(line)
        if m:
            kind, phase = (m[2], m[4] or "start") if m.re is _FIRED else ("slow", "start")
            for inj in out:
                if not inj.fired and inj.rank == int(m[1]) and inj.kind == kind and inj.phase == phase:
                    inj.fired = True
                    break
    return out


def account(injected: list[Injection], records: Sequence[dict], finished: bool) -> list[dict]:
    """Mark each injection absorbed, lost or pending, and return the deaths no injection explains. A death (a
    ``rank_failed`` event) explains the earliest fired injection of its launch rank not yet explained; a slowdown
    is absorbed when the run finished. ``finished``: the run completed every iteration and exited 0."""
    deaths = sorted((r for r in records if r.get("event") == "rank_failed"), key=lambda r: r["time"])
    reformed = [r["time"] for r in records if r.get("event") == "reformed"]
    unexplained = []
    for death in deaths:
        inj = next((i for i in injected if i.fired and i.kind != "slow" and i.outcome == "pending"
                    and i.rank == death["launch_rank"]), None)
        if inj is None:
            unexplained.append(death)
            continue
        went_on = finished or any(t > death["time"] for t in reformed)
        inj.outcome = "absorbed" if went_on else "lost"
    for inj in injected:
        if inj.fired and inj.outcome == "pending":
            inj.outcome = "absorbed" if inj.kind == "slow" and finished else "lost"
    return unexplained


def by_kind(injected: list[Injection]) -> dict[str, dict[str, int]]:
    """Per kind: injected, fired, absorbed, lost, pending."""
    out: dict[str, dict[str, int]] = defaultdict(Counter)  # type: ignore[arg-type]
    for inj in injected:
        c = out[inj.kind]
        c["injected"] += 1
        c["fired"] += inj.fired
        c[inj.outcome] += 1
    return {k: {n: c.get(n, 0) for n in ("injected", "fired", "absorbed", "lost", "pending")}
            for k, c in sorted(out.items())}


def _degraded(tp_per_replica: list, tp_base: int) -> bool:
    widths = [w for rep in tp_per_replica for w in (rep if isinstance(rep, list) else [rep])]
    return any(w < tp_base for w in widths)


def time_degraded(records: Sequence[dict], tp_base: int) -> tuple[float, float]:
    """Seconds of training during which some replica ran below ``tp_base`` (or was dropped), and that over the
    training time: each iteration record counts the time since the one before it."""
    its = [r for r in records if r.get("kind") == "iteration"]
    degraded = total = 0.0
    for before, now in zip(its, its[1:]):
        gap = max(0.0, now["time"] - before["time"])
        total += gap
        degraded += gap if _degraded(now["tp_per_replica"], tp_base) else 0.0
    return degraded, (degraded / total if total else 0.0)


def losses(records: Sequence[dict]) -> dict[int, float]:
    """lm loss per iteration (the last record of an iteration counts: a redone iteration is logged again)."""
    return {r["iteration"]: r["lm_loss"] for r in records if r.get("kind") == "iteration"}


def relative_difference(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def loss_against(got: dict[int, float], want: dict[int, float]) -> dict:
    """The soak's losses against the failure-free run's: iterations compared, missing, the largest relative
    difference (NaN counts as infinite), whether all are within :data:`LOSS_TOL`."""
    common = sorted(set(got) & set(want))
    diffs = {i: relative_difference(got[i], want[i]) for i in common}
    worst = max(((d if d == d else float("inf"), i) for i, d in diffs.items()), default=(0.0, None))
    missing = sorted(set(want) - set(got))
    over = sorted(i for i, d in diffs.items() if not d <= LOSS_TOL)
    return {"iterations": len(common), "missing": missing[:20], "missing_count": len(missing),
            "max_rel_delta": worst[0], "at_iteration": worst[1],
            "max_abs_delta": max((abs(got[i] - want[i]) for i in common), default=0.0),
            "over_tolerance": len(over), "first_over_tolerance": over[0] if over else None,
            "final_lm_loss": got[max(got)] if got else None,
            "reference_final_lm_loss": want[max(want)] if want else None,
            "equal": not missing and bool(common) and worst[0] <= LOSS_TOL}


@dataclass
class Sample:
    """One process's counts at one moment (/proc): ``role`` is ``launcher``, ``rank <r>`` or ``other``."""

    t: float
    pid: int
    role: str
    rss_mb: float
    threads: int
    fds: int


def generation_at(records: Sequence[dict], t: float) -> int:
    """The newest generation published at or before ``t`` (0 before any)."""
    gen = 0
    for r in records:
        if r.get("event") == "generation_published" and r["time"] <= t:
            gen = max(gen, r["generation"])
    return gen


def _grouped(samples: Sequence[Sample], records: Sequence[dict]) -> dict[tuple[str, int], dict[int, Sample]]:
    """(role, pid) -> generation -> that process's steady counts in that generation: the least of its samples there
    (a re-formation's transient threads and sockets, or a process on its way out, are not a leak), each count taken
    alone. Samples before generation 0 (the start-up) and after the ``job_ended`` event (the shutdown) are left out."""
    published = sorted((r["time"], r["generation"]) for r in records if r.get("event") == "generation_published")
    ended = min((r["time"] for r in records if r.get("event") == "job_ended"), default=float("inf"))
    begun = published[0][0] if published else float("-inf")
    out: dict[tuple[str, int], dict[int, Sample]] = defaultdict(dict)
    for s in sorted(samples, key=lambda s: s.t):
        if s.t > ended or s.t < begun:
            continue
        gen = max((g for t, g in published if t <= s.t), default=0)
        low = out[s.role, s.pid].get(gen)
        out[s.role, s.pid][gen] = s if low is None else Sample(
            low.t, s.pid, s.role, min(low.rss_mb, s.rss_mb), min(low.threads, s.threads), min(low.fds, s.fds))
    return out


@dataclass
class ResourceRow:
    """Counts of one kind of process (the launcher, or every rank process) over the soak."""

    what: str
    first: dict = field(default_factory=dict)
    last: dict = field(default_factory=dict)
    max: dict = field(default_factory=dict)
    growth: dict = field(default_factory=dict)
    """The largest growth of one process from the first generation it was sampled in to its last."""
    processes: int = 0


def resources(samples: Sequence[Sample], records: Sequence[dict]) -> list[ResourceRow]:
    """RSS, threads and fds of the launcher and of the rank processes: the first generation's steady counts (mean
    over its processes, :func:`_grouped`), the last's, the maximum of any sample, and the largest growth of one
    process's steady counts from the first generation it lived in to its last."""
    grouped = _grouped(samples, records)
    rows = []
    for what, pick in (("launcher", lambda role: role == "launcher"), ("ranks", lambda role: role.startswith("rank"))):
        mine = {key: gens for key, gens in grouped.items() if pick(key[0])}
        if not mine:
            continue
        row = ResourceRow(what, processes=len(mine))
        first_gen = min(g for gens in mine.values() for g in gens)
        last_gen = max(g for gens in mine.values() for g in gens)
        for attr in ("rss_mb", "threads", "fds"):
            firsts = [getattr(g[first_gen], attr) for g in mine.values() if first_gen in g]
            lasts = [getattr(g[last_gen], attr) for g in mine.values() if last_gen in g]
            row.first[attr] = sum(firsts) / len(firsts)
            row.last[attr] = sum(lasts) / len(lasts)
            row.max[attr] = max(getattr(s, attr) for s in samples if pick(s.role))
            row.growth[attr] = max(getattr(g[max(g)], attr) - getattr(g[min(g)], attr) for g in mine.values())
        rows.append(row)
    return rows


def rank_processes(records: Sequence[dict]) -> dict[tuple[int, int], list[dict]]:
    """(launch rank, first generation) -> the ``resources`` records of one rank process, one per generation it
    trained in (docs/metrics.md): a launch rank's records belong to a new process from the generation published
    after its ``replacement_started`` event."""
    published = sorted((r["time"], r["generation"]) for r in records if r.get("event") == "generation_published")
    starts: dict[int, list[int]] = defaultdict(list)
    for r in records:
        if r.get("event") == "replacement_started":
            starts[r["launch_rank"]].append(min((g for t, g in published if t >= r["time"]), default=1 << 30))
    out: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for r in sorted((r for r in records if r.get("kind") == "resources"), key=lambda r: r["generation"]):
        born = max((g for g in starts[r["launch_rank"]] if g <= r["generation"]), default=0)
        out[r["launch_rank"], born].append(r)
    return out


def rank_growth(records: Sequence[dict]) -> dict:
    """What the ranks said of themselves once per generation (``resources`` records, taken at the same point of every
    generation): per process of at least 3 generations, its floor (least threads, fds, RSS) over the last third of
    its generations against the floor over its first third — a leak raises the floor, a re-formation's helper thread
    or an ended generation held a moment longer (``held_generations``) does not; the largest growth, which process,
    how many processes grew."""
    worst: dict = {"threads": 0, "fds": 0, "rss_mb": 0.0, "processes": 0, "grew": 0, "longest_generations": 0}
    for (rank, born), recs in rank_processes(records).items():
        if len(recs) < 3:
            continue
        third = max(1, len(recs) // 3)
        worst["processes"] += 1
        worst["longest_generations"] = max(worst["longest_generations"], len(recs))
        grew = False
        for attr in ("threads", "fds", "rss_mb"):
            up = min(r[attr] for r in recs[-third:]) - min(r[attr] for r in recs[:third])
            grew = grew or (up > 0 and attr != "rss_mb")
            if up > worst[attr]:
                worst[attr], worst[f"{attr}_where"] = up, f"launch rank {rank} from generation {born}"
        worst["grew"] += grew
    return worst


def summary_event(records: Sequence[dict]) -> dict:
    return next((r for r in reversed(records) if r.get("event") == "job_summary"), {})


def report(log: str, records: Sequence[dict], reference: Sequence[dict], samples: Sequence[Sample], exit_code: int,
           tp_base: int, train_iters: int, leftover: Sequence[int]) -> dict:
    """Everything the soak says, as JSON-ready data."""
    got = losses(records)
    finished = exit_code == 0 and sorted(got) == list(range(1, train_iters + 1))
    injected = injections(log)
    unexplained = account(injected, records, finished)
    kinds = by_kind(injected)
    degraded_s, degraded_frac = time_degraded(records, tp_base)
    summary = summary_event(records)
    totals = {n: sum(k[n] for k in kinds.values()) for n in ("injected", "fired", "absorbed", "lost", "pending")}
    rows = resources(samples, records)
    return {
        "exit_code": exit_code, "finished": finished, "failures": totals, "by_kind": kinds,
        "lost": [vars(i) for i in injected if i.outcome == "lost"],
        "unexplained_deaths": [{k: d.get(k) for k in ("launch_rank", "cause", "time")} for d in unexplained],
        "deaths": sum(r.get("event") == "rank_failed" for r in records),
        "reformations": sum(r.get("event") == "reformed" for r in records),
        "rebalances": sum(r.get("event") == "rebalanced" for r in records),
        "generations": max((r["generation"] for r in records if r.get("event") == "generation_published"), default=0),
        "time_degraded_s": degraded_s, "time_degraded_fraction": degraded_frac,
        "goodput": summary.get("goodput"), "wall_s": summary.get("wall_s"),
        "job_stopped": [r.get("reason") for r in records if r.get("event") == "job_stopped"],
        "loss": loss_against(got, losses(reference)),
        "resources": [vars(r) for r in rows], "rank_growth": rank_growth(records),
        "leftover_processes": list(leftover),
        "verdict": verdict(totals, unexplained, finished, got, reference, rank_growth(records), leftover),
    }


def verdict(totals: dict, unexplained: list, finished: bool, got: dict, reference: Sequence[dict],
            growth: dict, leftover: Sequence[int]) -> dict:
    """Nothing lost, nothing leaked, loss equal: each a yes or no. Leaked: a process of the job left after it, or a
    rank process whose floor of threads or fds rose from its first generations to its last (:func:`rank_growth`; the
    /proc samples are shown, not judged: a 1 s sample of a generation of a few seconds catches re-formations' helper
    threads and sockets, and the launcher's threads follow how many processes it runs)."""
    grew = {a: growth[a] for a in ("threads", "fds") if growth[a] > 0}
    return {"nothing_lost": finished and totals["lost"] == 0 and not unexplained,
            "nothing_leaked": not leftover and not grew, "grew": grew,
            "loss_equal": loss_against(got, losses(reference))["equal"]}


def _num(v: Optional[float], fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def table(rep: dict) -> str:
    """The report as text: failures by kind, the run, the loss, resources."""
    lines = ["| kind | injected | fired | absorbed | lost | pending at the end |", "|---|---|---|---|---|---|"]
    for kind, c in {**rep["by_kind"], "all": rep["failures"]}.items():
        lines.append(f"| {kind} | {c['injected']} | {c['fired']} | {c['absorbed']} | {c['lost']} | {c['pending']} |")
    loss = rep["loss"]
    lines += ["", "| measure | value |", "|---|---|",
              f"| exit code | {rep['exit_code']} |", f"| deaths (rank_failed) | {rep['deaths']} |",
              f"| re-formations | {rep['reformations']} (rebalances {rep['rebalances']}) |",
              f"| generations | {rep['generations']} |",
              f"| time degraded | {rep['time_degraded_s']:.1f} s ({100 * rep['time_degraded_fraction']:.0f} %) |",
              f"| goodput | {_num(rep['goodput'] and 100 * rep['goodput'])} % of {_num(rep['wall_s'])} s |",
              f"| final lm loss (failure-free) | {_num(loss['final_lm_loss'], '{:.6f}')} "
              f"({_num(loss['reference_final_lm_loss'], '{:.6f}')}) |",
              f"| max rel. delta loss | {loss['max_rel_delta']:.2e} at iteration {loss['at_iteration']} over "
              f"{loss['iterations']} iterations ({loss['missing_count']} missing); absolute "
              f"{loss['max_abs_delta']:.1e} |",
              f"| iterations over rel. {LOSS_TOL:g} | {loss['over_tolerance']} "
              f"(first {loss['first_over_tolerance']}) |",
              "", "| /proc, per generation (least sample) | RSS MB first / last / max (growth) | threads | fds |",
              "|---|---|---|---|"]
    for r in rep["resources"]:
        cells = [f"{r['first'][a]:.0f} / {r['last'][a]:.0f} / {r['max'][a]:.0f} ({r['growth'][a]:+.0f})"
                 for a in ("rss_mb", "threads", "fds")]
        lines.append(f"| {r['what']} ({r['processes']}) | " + " | ".join(cells) + " |")
    g = rep["rank_growth"]
    lines += ["", f"rank processes' own records ({g['processes']} processes of 3 generations or more, up to "
              f"{g['longest_generations']}): floor of the last third of a process's generations against its first "
              f"third, largest: threads {g['threads']:+d}, fds {g['fds']:+d}, RSS {g['rss_mb']:+.0f} MB; "
              f"{g['grew']} processes grew in threads or fds" +
              "".join(f"; {a}: {g[a + '_where']}" for a in ("threads", "fds") if a + "_where" in g)]
    v = rep["verdict"]
    lines += ["", f"nothing lost: {'yes' if v['nothing_lost'] else 'NO'} | nothing leaked: "
              f"{'yes' if v['nothing_leaked'] else 'NO'} (left over: {rep['leftover_processes'] or 'none'}) | "
              f"loss equal (rel. {LOSS_TOL:g}): {'yes' if v['loss_equal'] else 'NO'}"]
    return "\n".join(lines)
