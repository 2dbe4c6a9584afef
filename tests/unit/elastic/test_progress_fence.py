"""Progress, not liveness (:class:`ntp_megatron.elastic.agent.Agent`): a rank whose heartbeat goes on but whose
progress count stands still, in a phase of an iteration, while another rank has waited on its peers for half of
``ntp.heartbeat_timeout_s``, is fenced by name; no other rank is (one that waits itself, one that works, one
outside an iteration's phases, or when nobody waits). The launcher's clock is passed in (``Agent._fence(now)``);
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


class _Proc:
    def __init__(self, rank: int) -> None:
        self.rank, self.pid = rank, os.getpid()  # a live process in state R or S (never signalled: see below)

    def poll(self):
        return None


@pytest.fixture
def fence(monkeypatch):
    """An agent over ranks 0..3 of one node, its kills recorded instead of sent, and a way to write beats."""
    killed: list[int] = []
    procs = {rank: _Proc(rank) for rank in range(4)}
    monkeypatch.setattr(agent_module, "_signal", lambda pid, sig: killed.append(sig))
    store = dist.HashStore()
    said: list[str] = []
    agent = Agent(store, lambda: procs, TIMEOUT_S, startup_grace_s=60.0, specs=[], say=said.append,
                  live=lambda: list(procs), fence_progress=True)
    start = agent.started

    def beats(now: float, **per_rank: dict) -> None:
        for rank in range(4):
            fields = {"iteration": 3, "phase": "forward", "progress": 0, "waiting_since": None,
                      **per_rank.get(f"r{rank}", {})}
            store.set(keys.heartbeat(rank), json.dumps({"t": now, **fields}))
        agent._fence(now)

    return agent, beats, said, killed, start


def test_the_rank_the_others_wait_on_is_fenced_by_name(fence):
    agent, beats, said, killed, t0 = fence
    waits = {"r0": {"waiting_since": t0, "progress": 7}, "r2": {"waiting_since": t0, "progress": 9}}
    beats(t0, r1={"progress": 5}, r3={"progress": 1}, **waits)
    beats(t0 + HALF - 0.1, r1={"progress": 5}, r3={"progress": 2}, **waits)
    assert not killed, "not yet half the timeout"
    beats(t0 + HALF + 0.1, r1={"progress": 5}, r3={"progress": 3}, **waits)
    assert killed == [signal.SIGKILL] and agent.notes.keys() == {1}
    [line] = said
    assert line.startswith("launch rank 1 ") and "stuck: no progress for 2.1 s in phase forward of iteration 3" in line
    assert "while launch rank 0 has waited on its peers" in line
    assert agent.notes[1][0] == t0, "it failed when it stopped progressing"


@pytest.mark.parametrize("case", ["nobody waits", "it waits too", "outside an iteration", "it works"])
def test_no_one_else_is_fenced(fence, case):
    agent, beats, said, killed, t0 = fence
    waiting_peer = {} if case == "nobody waits" else {"waiting_since": t0}
    stuck = {"progress": 5, "phase": "checkpoint" if case == "outside an iteration" else "backward",
             "waiting_since": t0 if case == "it waits too" else None}
    for step, now in enumerate((t0, t0 + 1.0, t0 + HALF + 0.5, t0 + TIMEOUT_S - 0.1)):
        if case == "it works":
            stuck["progress"] = 5 + step
        beats(now, r0=waiting_peer, r1=stuck, r2={"progress": step}, r3={"progress": step})
    assert not killed, said


def test_without_the_progress_fence_nobody_is_fenced_for_progress(fence):
    agent, beats, said, killed, t0 = fence
    agent.fence_progress = False
    waits = {"r0": {"waiting_since": t0}, "r2": {"waiting_since": t0}}
    for now in (t0, t0 + HALF + 0.1, t0 + TIMEOUT_S - 0.1):
        beats(now, r1={"progress": 5}, r3={"progress": int(now)}, **waits)
    assert not killed, said


def test_a_stall_no_longer_confirmed_is_over(fence):
    """Rank 0 waited, then its wait ended (no new stall): a rank idle since then is not fenced for it."""
    agent, beats, said, killed, t0 = fence
    busy = {"r2": {"progress": 1}, "r3": {"progress": 1}}
    beats(t0, r0={"waiting_since": t0}, r1={"progress": 5}, **busy)
    busy = {"r2": {"progress": 2}, "r3": {"progress": 2}}
    beats(t0 + HALF + 0.1, r0={"waiting_since": t0}, r1={"progress": 6}, **busy)  # the stall is published, 1 works
    assert json.loads(agent.store.get(keys.STALLED))["launch_rank"] == 0
    busy = {"r2": {"progress": 3}, "r3": {"progress": 3}}
    beats(t0 + HALF + 0.2, r0={"progress": 1}, r1={"progress": 6}, **busy)
    busy = {"r2": {"progress": 4}, "r3": {"progress": 4}}
    beats(t0 + 2 * HALF + 2.0, r0={"progress": 2}, r1={"progress": 6}, **busy)  # 1 idle > half, the stall stale
    assert not killed, said
    beats(t0 + 2 * HALF + 2.1, r0={"waiting_since": t0 + 2 * HALF + 2.0 - HALF - 0.1}, r1={"progress": 6},
          r2={"progress": 5}, r3={"progress": 5})
    assert agent.notes.keys() == {1}, "a new stall: the rank idle all along is the one the others wait on"


def test_a_wait_shorter_than_half_the_timeout_is_no_stall(fence):
    """Rank 1 froze at t0; rank 0 began waiting later and has waited less than half the timeout: nobody is
    fenced yet (a rank may be slow for a while), and once rank 0 has waited half the timeout, rank 1 is."""
    agent, beats, said, killed, t0 = fence
    beats(t0, r1={"progress": 5}, r2={"progress": 1}, r3={"progress": 1})
    late = t0 + HALF
    beats(late + HALF - 0.2, r0={"waiting_since": late}, r1={"progress": 5}, r2={"progress": 2}, r3={"progress": 2})
    assert not killed and not agent.store.check([keys.STALLED])
    beats(late + HALF + 0.1, r0={"waiting_since": late}, r1={"progress": 5}, r2={"progress": 3}, r3={"progress": 3})
    assert agent.notes.keys() == {1}


def test_the_heartbeat_says_where_the_rank_is_and_whether_it_waits():
    import threading

    phases.enter("grad_sync")
    before = beat()
    assert before["phase"] == "grad_sync" and before["waiting_since"] is None
    with waiting():
        inside = beat()
        assert inside["waiting_since"] is not None and wait_state() == inside["waiting_since"]
        with waiting():  # nested: the outer wait speaks for both
            assert beat()["waiting_since"] == inside["waiting_since"]
    after = beat()
    assert after["waiting_since"] is None and after["progress"] == before["progress"] + 1
    phases.tick()
    assert beat()["progress"] == after["progress"] + 1
    seen = []
    thread = threading.Thread(target=lambda: seen.append(_wait_in_thread()))
    thread.start()
    thread.join()
    assert seen == [None], "another thread's wait is not the rank's"
    phases.enter("start")  # as a fresh process: later tests of this process expect no iteration phase


def _wait_in_thread():
    with waiting():
        return wait_state()


def test_every_collective_wait_is_the_patched_one():
    from torch._C._distributed_c10d import Work

    from ntp_megatron.patches import torch_distributed_work

    torch_distributed_work.apply()
    assert Work.wait is torch_distributed_work._wait


@pytest.mark.parametrize("text, message", [
    ("spin:rank=1,iter=3", "spin needs a phase of an iteration (forward, backward, grad_sync, optimizer), got 'start'"),
    ("spin:rank=1,iter=3,phase=checkpoint", "spin needs a phase of an iteration"),
])
def test_spin_is_refused_outside_an_iteration(text, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        faults.parse_failure_spec(text, world_size=4, train_iters=10, checkpoints=True)


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
