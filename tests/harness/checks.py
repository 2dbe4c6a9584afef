"""Checks of a job's records: run segments, every live (replica, TP rank) agreeing on its state at every iteration, the
groups a re-formation made and kept as the plan says."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional


from tests.harness.processes import JobResult


def assert_ok(result: JobResult) -> None:
    assert result.returncode == 0, f"job failed ({result.returncode}):\n{result.stderr[-4000:]}"


def relative_difference(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


# -- run segments: a restart starts the controller (and the generation numbers) again --------------------------------

@dataclass
class Segment:
    """The records of one controller's run: from its ``generation_published`` event of generation 0 to the next
    one (a restart), or the whole file without NTP."""

    records: list[dict]

    def published(self) -> dict[int, dict]:
        return {r["generation"]: r for r in self.records if r.get("event") == "generation_published"}

    def iterations(self) -> dict[int, dict]:
        return {r["iteration"]: r for r in self.records if r.get("kind") == "iteration"}


def segments(records: list[dict]) -> list[Segment]:
    out: list[list[dict]] = [[]]
    for r in records:
        if r.get("event") == "generation_published" and r["generation"] == 0 and any(
                x.get("event") == "generation_published" for x in out[-1]):
            out.append([])
        out[-1].append(r)
    return [Segment(part) for part in out]


# -- every live (replica, TP rank) reports, and all agree ------------------------------------------------------------

def _live_tp_ranks(topology: dict) -> set[tuple[int, int]]:
    """(replica, TP rank) of every live rank of one stage's published topology."""
    return {(rep["index"], tp_rank) for rep in topology["replicas"] for tp_rank in range(len(rep["slots"]))}


def _stage_topology(topology: dict, stage: int) -> dict:
    """One pipeline stage's part of a published topology (the topology itself without stages)."""
    return topology["stages"][stage] if "stages" in topology else topology


def _widths(topology: dict, dp: int) -> list:
    """The iteration records' ``tp_per_replica`` of a published topology, read from its JSON: every replica index
    of the launch, its live slots (0 if it was dropped); with stages a list per replica, one entry per stage."""
    def stage_widths(stage: dict) -> list[int]:
        live = {rep["index"]: len(rep["slots"]) for rep in stage["replicas"]}
        return [live.get(r, 0) for r in range(dp)]

    if "stages" not in topology:
        return stage_widths(topology)
    per_stage = [stage_widths(stage) for stage in topology["stages"]]
    return [[widths[r] for widths in per_stage] for r in range(dp)]


def _stage_width(width, stage: int) -> int:
    """A replica's width in one stage, from a ``tp_per_replica`` entry (a list of widths with stages)."""
    return width[stage] if isinstance(width, list) else width


def interrupted_iterations(segment: Segment, last_segment: bool) -> dict[int, str]:
    """Iterations whose checksum rows may be incomplete, each with why: only the last iteration of a run segment that
    a failure ended (the job restarted from a checkpoint, or stopped), when a rank died in that iteration's
    generation. The rows of an iteration are gathered after its step; a death then ends every collective of the
    generation, and under NTP the next generation makes the check up (its rows are required below), but nothing
    trains on after a stop or a restart. Every other iteration's rows are checked in full."""
    iterations = segment.iterations()
    if not iterations:
        return {}
    last = max(iterations)
    generation = iterations[last].get("generation", 0)
    deaths = [e for e in segment.records if e.get("event") == "rank_failed"
              and e.get("generation", generation) == generation]
    ended = not last_segment or any(e.get("event") == "job_stopped" for e in segment.records)
    if deaths and ended:
        return {last: f"the last iteration before the {'restart' if not last_segment else 'stop'}, in generation "
                      f"{generation}, in which launch rank {deaths[0]['launch_rank']} died"}
    return {}


def _required_reporters(segment: Segment, iteration: int, stage: int = 0) -> tuple[int, set[tuple[int, int]]]:
    """(generation, the (replica, TP rank) pairs that must have reported the state after ``iteration`` in it): the
    generation that trained on from that state (the next iteration's; the iteration's own for the last one), its
    live ranks except the processes it admitted (they joined with the state and never stepped the iteration)."""
    iterations, generations = segment.iterations(), segment.published()
    own = iterations[iteration].get("generation", 0)
    after = iterations[iteration + 1].get("generation", 0) if iteration + 1 in iterations else own
    if not generations:  # NTP off: every replica at its TP degree
        widths = iterations[iteration]["tp_per_replica"]
        return own, {(rep, t) for rep, w in enumerate(widths) for t in range(_stage_width(w, stage))}
    topology = _stage_topology(generations[after]["topology"], stage)
    joined = {tuple(s) for s in generations[after]["joined"]} if after != own else set()
    return after, {(rep["index"], t) for rep in topology["replicas"] for t, slot in enumerate(rep["slots"])
                   if (rep["index"], slot) not in joined}


def assert_replicas_agree(result: JobResult, iters: Optional[int] = None) -> None:
    """At every recorded iteration, every live (replica, TP rank) reported state checksums, and all are the same:
    every tensor's checksum and the grad-norm bits, in whichever generation they were taken. Which ranks must have
    reported follows from what the job published (:func:`_required_reporters`), not from the reports; a rank of a
    generation reports the iterations it stepped itself, and a re-formation makes up the check a failure cut short,
    so the rows of an iteration can come from two generations (they must agree). ``iters``: iterations 1..iters must
    all have been recorded and checked.

    The only rows allowed missing are those of :func:`interrupted_iterations`; the assertion message names them."""
    checked: set[int] = set()
    all_segments = segments(result.records)
    stages = next((r.get("pipeline_stages", 1) for r in result.records if r.get("event") == "job_started"), 1)
    for n, segment in enumerate(all_segments):
        for stage in range(stages):  # each pipeline stage holds its own tensors: its rows are compared
            checked |= _check_stage_rows(Segment([r for r in segment.records if r.get("stage", 0) == stage]),
                                         last_segment=n == len(all_segments) - 1, stage=stage)
    assert checked, "no state checksums were reported (logging.state_checksums off?)"
    if iters is not None:
        unchecked = sorted(set(range(1, iters + 1)) - checked)
        assert not unchecked, f"iterations without checksums: {unchecked}"


def _check_stage_rows(segment: Segment, last_segment: bool, stage: int) -> set[int]:
    """:func:`assert_replicas_agree` for one run segment's records of one pipeline stage (iteration records and
    events are every stage's); returns the iterations checked."""
    checked: set[int] = set()
    where = f" (stage {stage})" if stage else ""
    generations, iterations = segment.published(), segment.iterations()
    rows: dict[int, dict[tuple[int, int, int], dict]] = defaultdict(dict)
    for r in segment.records:
        if r.get("kind") == "state_checksums":
            key = (r.get("generation", 0), r["replica"], r["tp_rank"])
            assert key not in rows[r["iteration"]], f"iteration {r['iteration']}{where}: {key} reported twice"
            rows[r["iteration"]][key] = r
    interrupted = interrupted_iterations(segment, last_segment=last_segment)
    for iteration, record in sorted(iterations.items()):
        widths = record["tp_per_replica"]
        generation = record.get("generation", 0)
        if generations:
            topology = generations[generation]["topology"]
            assert _widths(topology, len(widths)) == widths, (
                f"iteration {iteration}{where}: tp_per_replica {widths}, but generation {generation} has "
                f"{_widths(topology, len(widths))}")
        reports = rows.get(iteration, {})
        for g, replica, tp_rank in reports:
            live = _live_tp_ranks(_stage_topology(generations[g]["topology"], stage)) if generations else {
                (rep, t) for rep, w in enumerate(widths) for t in range(_stage_width(w, stage))}
            assert (replica, tp_rank) in live, (
                f"iteration {iteration}{where}: a report from {(replica, tp_rank)}, which is not live in generation {g}")
        due_in, required = _required_reporters(segment, iteration, stage)
        missing = sorted(required - {(rep, t) for g, rep, t in reports if g == due_in})
        if missing:
            assert iteration in interrupted, (
                f"iteration {iteration}{where}: no state checksums from (replica, TP rank) {missing} in generation "
                f"{due_in}; only the rows of {interrupted or 'no iteration'} may be missing")
            if not reports:
                checked.add(iteration)  # nothing to compare, for the reason interrupted_iterations gives
                continue
        first_key = min(reports)
        first = reports[first_key]
        for who, other in sorted(reports.items()):
            differing = [k for k in set(first["checksums"]) | set(other["checksums"])
                         if first["checksums"].get(k) != other["checksums"].get(k)]
            assert not differing, (
                f"iteration {iteration}{where}: {who} differs from {first_key} in {sorted(differing)[:3]}")
            assert other["grad_norm"] == first["grad_norm"], (
                f"iteration {iteration}{where}: grad-norm bits differ between {who} and {first_key}")
        checked.add(iteration)
    complete = [i for i in sorted(iterations) if i in checked and i not in interrupted]
    if len(complete) > 1:  # the state changes: a report of something constant would agree trivially
        a, b = rows[complete[0]], rows[complete[-1]]
        assert a[min(a)]["checksums"] != b[min(b)]["checksums"], f"the state checksums never change{where}"
    return checked


def _healthy(topology, replica: int) -> bool:
    """Replica ``replica`` has every slot of every stage live in ``topology`` (a job's)."""
    return all(any(rep.index == replica for rep in stage.replicas) and stage.is_healthy(replica)
               for stage in topology.stages)


def _group_names(keys) -> set[str]:
    return {k.name() for k in keys}


def assert_groups_as_planned(result: JobResult, dp: Optional[int] = None, instances: int = 1,
                             healthy_tp_kept: bool = False) -> int:
    """Every re-formation of ``result``, every rank: the groups it made and kept (its ``reform_rank`` record) against
    the plan worked out from the published topologies (``ntp_megatron.plan.group_plan.event_plan``). Every group the plan
    makes was made (or kept from a formation cut short after the base, which made it), and nothing outside the
    rank's groups; besides the plan's, a rank may make a group its members'
    verdict refused (a collective left half-matched by the failure), never at an admission boundary (nothing in
    flight: exactly the plan's). Every member of a group did the same with it (made it, or kept the same
    incarnation). With ``healthy_tp_kept`` (failures that strand nothing in a healthy replica's TP
    group), a rank of a replica healthy in both generations (every stage) kept its TP group: the same incarnation, bound as many
    times in its model, DDP and optimizer, and made only sync groups. Returns how many such ranks were seen.
    ``dp``: the launch data-parallel size (default: the replicas of generation 0)."""
    from ntp_megatron.plan.group_plan import event_plan, rank_group_keys
    from ntp_megatron.plan.stages import JobTopology

    published = {e["generation"]: e for e in result.events("generation_published")}
    topologies = {g: JobTopology.from_json(e["topology"]) for g, e in published.items()}
    records = {(r["generation"], r["launch_rank"]): r for r in result.records if r.get("kind") == "reform_rank"}
    start = topologies[0]
    if dp is None:
        dp = len(start.replica_indices)
    launch_of = {start.slot_of(lr): lr for lr in range(start.world_size)}
    kept_tp = 0
    for event in result.events("reformed"):
        g = event["generation"]
        base_g = published[g]["base"]
        base, new = topologies[base_g], topologies[g]
        # Every member of a group did the same with it: all made it in this generation, or all kept one incarnation.
        seen: dict = {}
        for rank in range(new.world_size):
            record = records.get((g, launch_of[new.slot_of(rank)]))
            for k in rank_group_keys(new, rank, dp, instances):
                name = k.name()
                seen.setdefault(k, set()).add((name in record["groups_made"], record["groups_made_in"][name]))
        split = {k.label(): v for k, v in seen.items() if len(v) != 1}
        assert not split, f"generation {g}: members of a group disagree on it: {split}"
        for rank in range(new.world_size):
            identity = new.slot_of(rank)
            record = records.get((g, launch_of[identity]))
            assert record is not None, f"generation {g}: no reform_rank record from {identity}"
            plan = event_plan(base, new, identity, dp=dp, instances=instances)
            made, kept = set(record["groups_made"]), set(record["groups_kept"])
            where = f"generation {g}, {identity}"
            # A group the plan makes was made, or kept from a formation after the base that was cut short (made
            # there by the same members).
            assert all(name in made or base_g < record["groups_made_in"][name] < g for name in _group_names(plan.make)), (
                where, "a group whose members changed was kept", record)
            if event["joined"]:
                assert made <= _group_names(plan.make), (where, "made more than the plan at a boundary", record)
            replica = identity[0]
            if not healthy_tp_kept or not (_healthy(base, replica) and _healthy(new, replica)):
                continue
            tp = f"tp[{identity[2] if len(identity) > 2 else 0}]"
            before = records.get((base_g, launch_of[identity]))
            assert tp in kept and all(name.startswith("sync") for name in made), (where, record)
            assert before is not None and record["groups_made_in"][tp] == before["groups_made_in"][tp], (
                where, "its TP group is another incarnation", before, record)
            assert record["tp_references"] == before["tp_references"] > 0, (where, before, record)
            kept_tp += 1
    return kept_tp
