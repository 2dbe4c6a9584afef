"""Progress, not liveness, on the launcher's side (:class:`ntp_megatron.elastic.agent.Agent`): a launcher publishes
its ranks that have waited on their peers for half of ``ntp.heartbeat_timeout_s`` (the patience) in the root store,
and fences those of its own ranks that hold a published wait up — behind the waiter in a group it waits in, no
progress for the patience, not waiting, in a phase of an iteration (:mod:`ntp_megatron.elastic.blame`, whose
rule has its own tests) — by name; no other rank, also when the waiter and the culprit are on different launchers.
The launcher's clocks are passed in (monotonic ``Agent._fence(now)`` for heartbeat ages, ``Agent.clock`` for progress);
the heartbeats are what :func:`ntp_megatron.elastic.watchdog.beat` writes."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch.distributed as dist

from ntp_megatron import faults, phases
from ntp_megatron.config.files import ConfigError
from ntp_megatron.elastic import agent as agent_module
from ntp_megatron.elastic import keys
from ntp_megatron.elastic.agent import Agent
from ntp_megatron.elastic.watchdog import beat
from ntp_megatron.phases import wait_state, waiting

TIMEOUT_S = 4.0
HALF = TIMEOUT_S / 2
TP0, TP1, S0, S1 = "tp[0]:aaaa@0", "tp[0]:bbbb@0", "sync[0, 0]:cccc@0", "sync[0, 1]:dddd@0"
GROUPS = {0: (TP0, S0), 1: (TP0, S1), 2: (TP1, S0), 3: (TP1, S1)}
"""TP2 x DP2: replica 0 is launch ranks 0 and 1, replica 1 ranks 2 and 3; sync groups (0, 2) and (1, 3)."""


class _Proc:
    def __init__(self, rank: int) -> None:
        self.rank, self.pid = rank, os.getpid()  # a live process in state R or S (never signalled: see below)

    def poll(self):
        return None


class _Node:
    """One launcher's agent over some ranks, its kills recorded instead of sent, on a clock the test moves."""

    def __init__(self, ranks: list[int], store: dist.Store, root: dist.Store, killed: list[int]) -> None:
        procs = {rank: _Proc(rank) for rank in ranks}
        self.said: list[str] = []
        self.store, self.t = store, 0.0
        self.agent = Agent(store, lambda: procs, TIMEOUT_S, startup_grace_s=60.0, specs=[], say=self.said.append,
                           live=lambda: list(procs), fence_progress=True, shared=root)
        self.agent.clock = lambda: self.t
        self.agent.name = f"node-of-{ranks[0]}"
        self.ranks = ranks

    def beats(self, t: float, **per_rank: dict) -> None:
        """At ``t`` seconds: each of this node's ranks beats (counts, wait, progress, phase as given), then the agent
        polls."""
        self.t = t
        now = self.agent.started + t
        for rank in self.ranks:
            fields = {"iteration": 3, "phase": "forward", "progress": 0, "wait": None,
                      "seq": dict(zip(GROUPS[rank], (10, 2))), **per_rank.get(f"r{rank}", {})}
            self.store.set(keys.heartbeat(rank), json.dumps({"t": now, **fields}))
        self.agent._fence(now)


@pytest.fixture
def nodes(monkeypatch):
    """``nodes(*rank lists)``: one launcher per list, each with its own node store, all sharing one root."""
    killed: list[int] = []
    monkeypatch.setattr(agent_module, "_signal", lambda pid, sig: killed.append(sig))
    root = dist.HashStore()

    def make(*rank_lists: list[int]) -> list[_Node]:
        return [_Node(ranks, root if i == 0 else dist.HashStore(), root, killed) for i, ranks in enumerate(rank_lists)]

    make.killed = killed
    make.root = root
    return make


def waits(s: float, on=None) -> dict:
    return {"s": s, "on": on}


def spin(t: float) -> dict:
    """Launch rank 2 froze at t = 0 in forward, behind 3 in TP1; 3 waits on it since 0; replica 0 works."""
    return {"r2": {"progress": 5, "seq": {TP1: 10, S0: 2}},
            "r3": {"progress": 7, "seq": {TP1: 11, S1: 2}, "wait": waits(t)},
            "r0": {"progress": int(t * 10)}, "r1": {"progress": int(t * 10)}}


def test_the_rank_the_others_wait_on_is_fenced_by_name(nodes):
    [node] = nodes([0, 1, 2, 3])
    node.beats(0.0, **spin(0.0))
    node.beats(HALF - 0.1, **spin(HALF - 0.1))
    assert not nodes.killed, "not yet half the timeout"
    node.beats(HALF + 0.1, **spin(HALF + 0.1))
    assert nodes.killed == [signal.SIGKILL] and node.agent.notes.keys() == {2}
    [line] = node.said
    assert line.startswith("launch rank 2 ") and "stuck: no progress for 2.1 s in phase forward of iteration 3" in line
    assert f"while launch rank 3 has waited 2.1 s on it in group {TP1} (for collective 11; this rank entered 10" in line
    # It failed when it stopped progressing, noted in wall time (the record's).
    assert node.agent.notes[2][0] == pytest.approx(agent_module.wall_time(node.agent.started), abs=0.5)


def test_the_waiter_and_the_culprit_on_different_launchers(nodes):
    """Launch ranks 0, 1 on node 0's launcher (the root's store), 2, 3 on node 1's (a store of its own): rank 0
    waits in S0 on rank 2. The
    waiter's launcher publishes the wait in the root; the culprit's launcher fences its own rank; nobody fences a
    rank of another launcher; the entry is emptied once the wait ends."""
    first, second = nodes([0, 1], [2, 3])

    def at(t: float, waiting: bool = True) -> None:
        per = {"r0": {"progress": 3, "seq": {TP0: 20, S0: 3}, "wait": waits(t) if waiting else None},
               "r1": {"progress": int(t * 10)}, "r2": {"progress": 5, "seq": {TP1: 10, S0: 2}},
               "r3": {"progress": 6, "seq": {TP1: 10, S1: 2}, "wait": waits(t)}}
        second.beats(t, **per)
        first.beats(t, **per)

    at(0.0)
    at(HALF + 0.1)  # the second launcher polled before the first published: nothing yet
    assert json.loads(nodes.root.get(keys.WAITS))["node-of-0"][0]["launch_rank"] == 0
    at(HALF + 0.2)
    assert second.agent.notes.keys() == {2} and not first.agent.notes, (first.said, second.said)
    assert "while launch rank 0 has waited" in second.said[0] and f"in group {S0}" in second.said[0]
    at(HALF + 0.3, waiting=False)
    assert "node-of-0" not in json.loads(nodes.root.get(keys.WAITS)), "the wait ended: its entry goes"


def test_a_rank_frozen_elsewhere_is_not_fenced(nodes):
    """Rank 1 makes no progress in the optimizer step while rank 3 waits on rank 2: only rank 2 is fenced."""
    [node] = nodes([0, 1, 2, 3])
    frozen = {"r1": {"progress": 9, "phase": "optimizer", "seq": {TP0: 12, S1: 3}}}
    for t in (0.0, HALF + 0.1):
        node.beats(t, **{**spin(t), **frozen})
    assert node.agent.notes.keys() == {2}


@pytest.mark.parametrize("case", ["it progresses", "it waits too", "outside an iteration", "level with the waiter",
                                  "the wait is short", "no progress fence"])
def test_no_one_else_is_fenced(nodes, case):
    [node] = nodes([0, 1, 2, 3])
    node.agent.fence_progress = case != "no progress fence"
    for step, t in enumerate((0.0, 1.0, HALF + 0.5, TIMEOUT_S - 0.1)):
        per = spin(t if case != "the wait is short" else t / 2)
        if case == "it progresses":
            per["r2"]["progress"] = 5 + step
        elif case == "it waits too":
            per["r2"]["wait"] = waits(t)
        elif case == "outside an iteration":
            per["r2"]["phase"] = "checkpoint"
        elif case == "level with the waiter":
            per["r2"]["seq"] = {TP1: 11, S0: 2}
        node.beats(t, **per)
    assert not nodes.killed, node.said


def test_the_heartbeat_says_where_the_rank_is_and_whether_it_waits():
    import threading

    phases.enter("grad_sync")
    before = beat()
    assert before["phase"] == "grad_sync" and before["wait"] is None and before["seq"] == {}
    with waiting():
        inside = beat()
        assert inside["wait"]["on"] is None and 0 <= inside["wait"]["s"] < 5.0 and wait_state() is not None
        with waiting():  # nested: the outer wait speaks for both
            assert beat()["wait"]["s"] >= inside["wait"]["s"]
    after = beat()
    assert after["wait"] is None and after["progress"] == before["progress"] + 1
    phases.tick()
    assert beat()["progress"] == after["progress"] + 1
    seen = []
    thread = threading.Thread(target=lambda: seen.append(_wait_in_thread()))
    thread.start()
    thread.join()
    assert seen == [None], "another thread's wait is not the rank's"
    phases.enter(phases.SETUP)  # as a fresh process: later tests of this process expect no iteration phase


def _wait_in_thread():
    with waiting():
        return wait_state()


def test_every_collective_wait_is_the_patched_one():
    from torch._C._distributed_c10d import Work

    from ntp_megatron.patches import torch_distributed_work

    torch_distributed_work.apply()
    assert Work.wait is torch_distributed_work._wait


def test_a_rank_whose_heartbeat_comes_late_is_not_still_but_unknown(nodes):
    """Rank 2's heartbeat thread is held up (its main thread holds the GIL, working): its last beat, from t = 0, says
    the count it had then. Older than ``timing.stale_beats`` intervals, it says nothing of progress: rank 2 is not
    fenced however long 3 waits; once a fresh beat shows the same count, it has stood still since t = 0."""
    [node] = nodes([0, 1, 2, 3])
    node.beats(0.0, **spin(0.0))
    late = {"t": node.agent.started}
    node.beats(HALF + 0.1, **{**spin(HALF + 0.1), "r2": {**spin(0.0)["r2"], **late}})
    node.beats(TIMEOUT_S - 0.5, **{**spin(TIMEOUT_S - 0.5), "r2": {**spin(0.0)["r2"], **late}})
    assert not nodes.killed, node.said
    node.beats(TIMEOUT_S - 0.4, **spin(TIMEOUT_S - 0.4))  # a fresh beat: the count of t = 0
    assert nodes.killed == [signal.SIGKILL] and "stuck: no progress for 3.6 s" in node.said[0]


@pytest.mark.parametrize("text, message", [
    ("spin:rank=1,iter=3,phase=eval", "spin needs a phase of an iteration (start, forward, backward, grad_sync, "
                                      "optimizer, param_gather), got 'eval'"),
    ("spin:rank=1,iter=3,phase=checkpoint", "spin needs a phase of an iteration"),
])
def test_spin_is_refused_outside_an_iteration(text, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        faults.parse_failure_spec(text, world_size=4, train_iters=10, checkpoints=True)


@pytest.mark.parametrize("phase", ["start", "param_gather"])
def test_spin_may_fire_from_an_iteration_s_start_to_its_parameter_gather(phase):
    spec = faults.parse_failure_spec(f"spin:rank=1,iter=3,phase={phase}", world_size=4, train_iters=10)
    assert (spec.action, spec.phase) == ("spin", phase)
    assert phase in faults.random_phases("spin")


def test_the_first_micro_batch_is_read_in_forward():
    """A data read that hangs in an iteration's first micro-batch is the forward's (a suspect phase), not the
    phase before it."""
    from ntp_megatron.training.steps import ForwardStep

    class Reading(Exception):
        pass

    seen = []

    def data():
        seen.append(phases.current()[1])
        raise Reading()
        yield  # a generator

    phases.enter("start")  # the iteration's start mark
    with pytest.raises(Reading):
        ForwardStep(4)(data(), model=None)
    phases.enter(phases.SETUP)
    assert seen == ["forward"]


def test_spin_needs_ntp():
    with pytest.raises(ConfigError, match="spin needs ntp.enabled"):
        faults.parse_failure_spec("spin:rank=1,iter=3,phase=forward", world_size=4, train_iters=10, ntp=False)
    spec = faults.parse_failure_spec("spin:rank=1,iter=3,phase=backward", world_size=4, train_iters=10)
    assert (spec.action, spec.rank, spec.iteration, spec.phase) == ("spin", 1, 3, "backward")
    assert str(spec) == "spin:rank=1,iter=3,phase=backward"


def test_every_layer_marks_progress_in_forward_and_in_backward(megatron):
    """``ntp.progress_fence``'s model marks: a real NTP GPT (two layers, one-rank world) moves the progress count
    at each layer's forward and backward, so a working rank's count moves within a micro-batch."""
    import torch

    from ntp_megatron.config.schema import load_job_config
    from ntp_megatron.plan.layout import make_topology
    from ntp_megatron.core.gpt import RankUnits, build_ntp_gpt
    from ntp_megatron.training.model import mark_progress, transformer_config

    cfg = load_job_config(overrides=["ntp.enabled=true", "training.device=cpu", "ntp.progress_fence=true",
                                     "parallel.tensor_model_parallel_size=1", "parallel.data_parallel_size=1"])
    m, tf_config = cfg.model, transformer_config(cfg, torch.device("cpu"))
    topology = make_topology(1, 1, cfg.unit_counts())
    units = RankUnits(*(tuple(topology.units_of(0, f)) for f in ("heads", "ffn", "vocab")))
    gpt = build_ntp_gpt(tf_config, units, m.normalization, m.vocab_size, max_sequence_length=m.seq_length,
                        pre_process=True, post_process=True, share_embeddings_and_output_weights=True,
                        position_embedding_type=m.position_embedding_type, pg_collection=megatron)
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(1234)  # the attention's RNG fork (dropout is 0)
    tokens = torch.randint(0, m.vocab_size, (1, 8))
    positions = torch.arange(8).unsqueeze(0)

    def run() -> tuple[int, int]:
        start = phases.progress()
        loss = gpt(tokens, positions, None, labels=tokens).float().mean()
        forward = phases.progress()
        loss.backward()
        return forward - start, phases.progress() - forward

    without = run()  # the model's own waits, if any (patched Work.wait in this process)
    mark_progress(gpt)
    with_marks = run()
    assert (with_marks[0] - without[0], with_marks[1] - without[1]) == (m.num_layers, m.num_layers)
