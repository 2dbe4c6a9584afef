"""Pipeline stages against plain Megatron-Core: NTP on PP2 with dead slots in stage 0, in stage 1 and in both
(PP2 × TP2 × 2 replicas, 8 gloo ranks), and at TP4 next to TP3 (PP2 × TP4 × 1), with untied (the Llama case) and
tied embeddings; the same job with NTP off; and their checkpoints.

The reference is ``tests/plain_megatron.py`` (a process that never imports ntp-megatron) at PP1 × TP1 and at
PP2 × TP2, both × DP2, started from the NTP jobs' initial weights (``--init-state``: the stages' dumps of
``logging.dump_state`` merged under PP1 names; every NTP job of one kind of embeddings starts from the same ones)
and trained on the same global batches. Per iteration the lm loss and the grad norm of every layout must agree
within ``TOL`` (1e-5 relative), and plain Megatron-Core's own two layouts with each other (its spread between
layouts, measured in the same test, must lie within it too); every replica of an NTP job reports the same state
checksums per stage after every iteration, and every rank's measured training state equals the memory plan of its
stage.

The dead slots: ``stage0`` one replica degraded in the first stage; ``stage1`` one in the last, tied; ``both``
replica 1 degraded in both stages (crossed slots) and every replica of stage 1 degraded, so stage 1's checkpoint
writer is a degraded replica; ``wide`` the last stage at TP3 after a TP4 first stage, tied.

Checkpoints, saved at iteration 3 of 6: ``both``'s resumes under NTP at PP1 × TP2 and under plain Megatron-Core at
PP2 × TP2, ``stage1``'s (tied) under plain Megatron-Core at PP1 × TP1; the loss continues the uninterrupted run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.equivalence_cases import PLAIN_TIMEOUT_S, TOL, PlainServer
from tests.harness import TINY, assert_ok, assert_replicas_agree, relative_difference, run_job
from tests.jobs.live.test_reform_memory import memory_records

pytestmark = pytest.mark.job

ITERS = 6
SAVE_AT = 3


@dataclass(frozen=True)
class Case:
    dead: tuple[str, ...]
    tied: bool
    tp: int = 2
    dp: int = 2
    save: bool = False


CASES = {
    "stage0": Case(("1:0@0",), tied=False),
    "stage1": Case(("0:1@1",), tied=True, save=True),
    "both": Case(("1:0@0", "0:0@1", "1:1@1"), tied=False, save=True),
    "wide": Case(("0:2@1",), tied=True, tp=4, dp=1),
}


def pipeline_args(ntp: bool, pp: int, tp: int, dead=(), extra: tuple[str, ...] = (), tied: bool = False,
                  dp: int = 2) -> list[str]:
    return [*TINY, "--set", f"ntp.enabled={str(ntp).lower()}", "--set", f"parallel.pipeline_model_parallel_size={pp}",
            "--set", f"parallel.tensor_model_parallel_size={tp}", "--set", f"parallel.data_parallel_size={dp}",
            "--set", f"model.untie_embeddings_and_output_weights={str(not tied).lower()}",
            "--set", "model.init=layout_free", "--set", f"training.train_iters={ITERS}",
            "--set", "logging.state_checksums=true", "--set", f"ntp.dead_slots={json.dumps(list(dead))}", *extra]


def records(result) -> dict[int, dict]:
    return {r["iteration"]: r for r in result.records if r.get("kind") == "iteration"}


def merged_state(state_dir: Path, replica: int, initial: bool) -> dict:
    """One replica's full state from its stages' dumps, under PP1 names (a tensor two stages both hold, as the
    tied embeddings, must be the same bits in both)."""
    out: dict = {}
    for stage in (0, 1):
        for key, value in torch.load(state_dir / f"replica{replica}.stage{stage}{'.init' if initial else ''}.pt").items():
            assert key not in out or torch.equal(out[key], value), key
            out[key] = value
    return out


def plain(out_dir: Path, tied: bool, *args: str) -> dict[int, dict]:
    """Plain Megatron-Core's per-iteration records (``--full-records``) of one run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "records.json"
    untie = () if tied else ("--untie-embeddings-and-output-weights",)
    code = PlainServer.run(["train", *untie, "--dp", "2", "--iters", str(ITERS), "--out", str(out), "--full-records",
                            *args],
                           out_dir / "plain.stdout", out_dir / "plain.stderr", PLAIN_TIMEOUT_S)
    assert code == 0, (out_dir / "plain.stderr").read_text(errors="replace")[-4000:]
    return {int(i): r for i, r in json.loads(out.read_text()).items()}


def assert_close(got: dict[int, dict], want: dict[int, dict], what: str, iters=range(1, ITERS + 1)) -> None:
    for i in iters:
        for key in ("lm_loss", "grad_norm"):
            diff = relative_difference(got[i][key], want[i][key])
            assert diff <= TOL, f"{what}, iteration {i}: {key} {got[i][key]!r} vs {want[i][key]!r} ({diff:.2e})"


@pytest.fixture(scope="module")
def ntp_jobs(tmp_path_factory):
    """The NTP jobs, each with its state dumps; those that save write a checkpoint at iteration 3."""
    out = {}
    for name, case in CASES.items():
        run_dir = tmp_path_factory.mktemp(f"pp-ntp-{name}")
        extra = ["--set", f"logging.dump_state={run_dir / 'state'}"]
        if case.save:
            extra += ["--set", f"checkpoint.save={run_dir / 'ckpt'}", "--set", f"checkpoint.save_interval={SAVE_AT}"]
        out[name] = run_job(run_dir / "run", pipeline_args(True, 2, case.tp, case.dead, tuple(extra), case.tied,
                                                           case.dp))
        assert_ok(out[name])
        out[name].state_dir = run_dir / "state"
        out[name].ckpt = run_dir / "ckpt"
    return out


@pytest.fixture(scope="module")
def references(ntp_jobs, tmp_path_factory):
    """Plain Megatron-Core at PP1 × TP1 and PP2 × TP2 from the NTP jobs' initial weights, untied and tied."""
    base = tmp_path_factory.mktemp("pp-plain")
    out = {}
    for tied in (False, True):
        jobs = {name: ntp_jobs[name] for name, case in CASES.items() if case.tied is tied}
        init = merged_state(next(iter(jobs.values())).state_dir, 0, initial=True)
        for name, job in jobs.items():  # every NTP job started from the same weights, whatever its layout
            for replica in range(CASES[name].dp):
                other = merged_state(job.state_dir, replica, initial=True)
                assert set(other) == set(init) and all(torch.equal(other[k], init[k]) for k in init), name
        kind = "tied" if tied else "untied"
        path = base / f"init-{kind}.pt"
        torch.save({k: v for k, v in init.items() if not k.endswith(("exp_avg", "exp_avg_sq"))}, path)
        for layout, tp, pp in (("pp1tp1", "1", "1"), ("pp2tp2", "2", "2")):
            out[tied, layout] = plain(base / kind / layout, tied, "--tp", tp, "--pp", pp, "--init-state", str(path),
                                      "--save-at", "0", "--ckpt", str(base / kind / layout / "unused"))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_ntp_pipeline_computes_plain_megatron(ntp_jobs, references, name):
    case, job = CASES[name], ntp_jobs[name]
    plain_pp1, plain_pp2 = references[case.tied, "pp1tp1"], references[case.tied, "pp2tp2"]
    assert_close(plain_pp2, plain_pp1, "plain Megatron-Core PP2 TP2 vs PP1 TP1 (its spread)")
    got = records(job)
    widths = [[case.tp - sum(d.startswith(f"{r}:") and d.endswith(f"@{s}") for d in case.dead) for s in range(2)]
              for r in range(case.dp)]
    assert all(got[i]["tp_per_replica"] == widths for i in got), (got[1]["tp_per_replica"], widths)
    for layout, want in (("PP1 TP1", plain_pp1), ("PP2 TP2", plain_pp2)):
        assert_close(got, want, f"NTP {list(case.dead)} ({'tied' if case.tied else 'untied'}) vs plain "
                                f"Megatron-Core {layout}")
    assert_replicas_agree(job, ITERS)
    memory_records(job)  # every rank's measured state is its stage's plan


def test_plain_pipeline_is_plain_megatron(references, tmp_path):
    """The same job with NTP off (Megatron's dense grid, PP2 × TP2 × 2) against the reference at its own layout."""
    result = run_job(tmp_path / "run", pipeline_args(False, 2, 2))
    assert_ok(result)
    assert_close(records(result), references[False, "pp2tp2"], "plain PP2 TP2 job vs plain Megatron-Core PP2 TP2")
    assert_replicas_agree(result, ITERS)


def saved(job) -> Path:
    assert (job.ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    ckpt = job.ckpt / f"iter_{SAVE_AT:07d}"
    assert ckpt.is_dir()
    return ckpt


RESUMED = range(SAVE_AT + 1, ITERS + 1)


def test_a_degraded_pipeline_checkpoint_resumes_under_pp1_and_plain_megatron_pp2(ntp_jobs, tmp_path):
    saver = ntp_jobs["both"]
    ckpt, uninterrupted = saved(saver), records(saver)
    resumed = run_job(tmp_path / "pp1", pipeline_args(True, 1, 2, extra=("--set", f"checkpoint.load={ckpt}")))
    assert_ok(resumed)
    assert sorted(records(resumed)) == list(RESUMED)
    assert_close(records(resumed), uninterrupted, "NTP PP1 TP2 resumed", RESUMED)
    megatron = plain(tmp_path / "megatron", False, "--tp", "2", "--pp", "2", "--load", str(ckpt), "--save-at", "0",
                     "--ckpt", str(tmp_path / "unused"))
    assert sorted(megatron) == list(RESUMED)
    assert_close(megatron, uninterrupted, "plain Megatron-Core PP2 TP2 resumed", RESUMED)


def test_a_tied_pipeline_checkpoint_resumes_under_plain_megatron_pp1(ntp_jobs, tmp_path):
    saver = ntp_jobs["stage1"]
    ckpt, uninterrupted = saved(saver), records(saver)
    megatron = plain(tmp_path / "megatron", True, "--tp", "1", "--pp", "1", "--load", str(ckpt), "--save-at", "0",
                     "--ckpt", str(tmp_path / "unused"))
    assert sorted(megatron) == list(RESUMED)
    assert_close(megatron, uninterrupted, "plain Megatron-Core PP1 TP1 resumed (tied)", RESUMED)
