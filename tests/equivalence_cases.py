"""Drawn equivalence cases: an NTP topology, GPT options and DDP settings, and how to compare the NTP run
with plain Megatron-Core at TP1 on the same samples. Shared by the suite's property tests and
``scripts/fuzz_equivalence.sh``.

``EXAMPLES`` are the fixed cases every suite run checks; ``FRESH_SEED`` seeds the few freshly drawn ones (a new
seed per run unless ``NTP_EQUIVALENCE_SEED`` names one; the suite prints it in its header).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
from hypothesis import strategies as st

from tests.harness import JobResult, _Zygote, relative_difference

MAX_RANKS = 8
ITERS = 3
SEQ_LENGTH = 32
MICRO_BATCH = 2
TOL = 1e-5          # lm loss and grad norm per iteration
STATE_TOL = 5e-5    # each tensor's relative L2 difference at the end. Adam's division turns the round-off of any TP
                    # width into differences in a few elements at step 1, and later gradients carry them: measured on
                    # one drawn model, 9.6e-6 for a uniform TP2 x 2 (plain Megatron's layout), 2.5e-5 with a TP3 replica
PEAK_TOL = 1e-4     # each tensor's largest elementwise difference relative to its largest entry: Adam turns
                    # round-off in near-zero gradients into whole steps (plain Megatron TP2 vs TP1: 1.1e-5)
VOCABS = (257, 259, 263, 265, 269, 271)  # no width 2..4 divides them
OUTLIER_SHARE = 1e-3  # of a parameter's elements may exceed PEAK_TOL (at least one), see adam_outliers ...
OUTLIER_STEP = 1e-2   # ... each by at most this share of the largest Adam step (learning rate x iterations)
FRESH_SEED = int(os.environ.get("NTP_EQUIVALENCE_SEED") or secrets.randbelow(2 ** 32))


@dataclass(frozen=True)
class Case:
    tp_base: int
    dp: int
    dead: tuple[tuple[int, int], ...]
    num_layers: int
    query_groups: int
    heads_per_group: int
    kv_channels: int
    hidden_size: int
    ffn_hidden_size: int
    vocab_size: int
    position: str
    normalization: str
    untie: bool
    activation: str
    overlap: bool
    bucket_size: Optional[int]
    clip_grad: float
    micro_batches: int
    dist_opt: bool = False
    """Megatron's distributed optimizer."""
    instances: Optional[int] = None
    """Its ``num_distributed_optimizer_instances`` (None: the configuration's default)."""

    @property
    def heads(self) -> int:
        return self.query_groups * self.heads_per_group

    @property
    def widths(self) -> list[int]:
        return [self.tp_base - sum(1 for r, _ in self.dead if r == replica) for replica in range(self.dp)]

    def model_args(self, init: str = "layout_free") -> list[str]:
        """Model, batch and optimizer settings shared by the NTP run and its TP1 reference; ``init``: the initial
        weights (``megatron``: Megatron-Core's own CPU initialisation, as plain Megatron-Core draws it)."""
        gated = self.activation == "swiglu"
        sets = {
            "model.num_layers": self.num_layers, "model.hidden_size": self.hidden_size,
            "model.num_attention_heads": self.heads, "model.num_query_groups": self.query_groups,
            "model.kv_channels": self.kv_channels, "model.ffn_hidden_size": self.ffn_hidden_size,
            "model.vocab_size": self.vocab_size, "model.seq_length": SEQ_LENGTH,
            "model.position_embedding_type": self.position, "model.normalization": self.normalization,
            "model.untie_embeddings_and_output_weights": str(self.untie).lower(),
            "model.activation": self.activation, "model.gated_linear_unit": str(gated).lower(),
            "model.hidden_dropout": 0.0, "model.attention_dropout": 0.0,
            "training.train_iters": ITERS, "training.micro_batch_size": MICRO_BATCH,
            "training.global_batch_size": self.global_batch_size,
            "training.lr_warmup_iters": 1, "training.clip_grad": self.clip_grad,
            "logging.log_interval": 1, "logging.tensorboard_dir": "", "ntp.enabled": "false",
            "model.init": init,
        }
        return [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]

    def ntp_args(self, init: str = "layout_free") -> list[str]:
        sets = {
            "parallel.tensor_model_parallel_size": self.tp_base, "parallel.data_parallel_size": self.dp,
            "ntp.enabled": "true", "logging.state_checksums": "true",
            "parallel.overlap_grad_reduce": str(self.overlap).lower(),
        }
        if self.bucket_size is not None:
            sets["parallel.ddp_bucket_size"] = self.bucket_size
        if self.dist_opt:
            sets["parallel.use_distributed_optimizer"] = "true"
        if self.instances is not None:
            sets["parallel.num_distributed_optimizer_instances"] = self.instances
        if self.dead:
            sets["ntp.dead_slots"] = "[" + ",".join(f"{r}:{s}" for r, s in self.dead) + "]"
        return self.model_args(init) + [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]

    @property
    def distributed_optimizer_instances(self) -> int:
        """The instances the NTP run uses (the configuration's default where the case names none)."""
        from ntp_megatron.config.schema import distributed_optimizer_instances

        return distributed_optimizer_instances(self.instances, ntp=True, distributed_optimizer=self.dist_opt,
                                               data_parallel_size=self.dp)

    def plain_args(self) -> list[str]:
        """``tests/plain_megatron.py train`` at TP1 × DP ``dp`` on the same samples, model, optimizer and schedule,
        with the case's distributed optimizer (the same number of instances) and overlap."""
        m = {"num-layers": self.num_layers, "hidden-size": self.hidden_size, "num-attention-heads": self.heads,
             "num-query-groups": self.query_groups, "kv-channels": self.kv_channels,
             "ffn-hidden-size": self.ffn_hidden_size, "vocab-size": self.vocab_size, "seq-length": SEQ_LENGTH,
             "position-embedding-type": self.position, "normalization": self.normalization,
             "global-batch-size": self.global_batch_size, "micro-batch": MICRO_BATCH, "clip-grad": self.clip_grad,
             "tp": 1, "dp": self.dp, "iters": ITERS}
        args = [arg for key, value in m.items() for arg in (f"--{key}", str(value))]
        args += {"gelu": [], "swiglu": ["--swiglu"], "squared_relu": ["--squared-relu"]}[self.activation]
        if self.untie:
            args.append("--untie-embeddings-and-output-weights")
        if self.dist_opt:
            args += ["--dist-opt", "--instances", str(self.distributed_optimizer_instances)]
        if self.overlap:
            args.append("--overlap")
        if self.bucket_size is not None:
            args += ["--bucket-size", str(self.bucket_size)]
        return args

    @property
    def global_batch_size(self) -> int:
        return MICRO_BATCH * self.dp * self.micro_batches

    def reference_args(self) -> list[str]:
        """Plain Megatron-Core (NTP off) at TP1 × DP1 on the same global batch: the same samples."""
        return self.model_args() + ["--set", "parallel.tensor_model_parallel_size=1",
                                    "--set", "parallel.data_parallel_size=1"]

    def to_json(self) -> dict:
        return asdict(self)


@st.composite
def cases(draw) -> Case:
    tp_base = draw(st.integers(1, 4))
    dp = draw(st.integers(1, 3))
    dead: list[tuple[int, int]] = []
    for replica in range(dp):
        lost = draw(st.sets(st.integers(0, tp_base - 1), max_size=tp_base - 1))
        dead += [(replica, slot) for slot in sorted(lost)]
    # At most MAX_RANKS processes: kill further slots (never a replica's last) until the job fits.
    while dp * tp_base - len(dead) > MAX_RANKS:
        alive = [(r, s) for r in range(dp) for s in range(tp_base)
                 if (r, s) not in dead and sum(1 for d in dead if d[0] == r) < tp_base - 1]
        dead.append(draw(st.sampled_from(alive)))
    query_groups = draw(st.integers(tp_base, max(tp_base, 6)))
    heads_per_group = draw(st.sampled_from([1, 2]))
    activation = draw(st.sampled_from(["gelu", "swiglu", "squared_relu"]))
    dist_opt = draw(st.booleans())
    instances = (draw(st.sampled_from([1, 2])) if dp % 2 == 0 else 1) if dist_opt else None
    # Not with two instances and a degraded replica: on gloo that is refused (ntp_megatron.core.grad_sync.GradSync).
    overlap = draw(st.booleans()) if not (instances == 2 and dead) else False
    # Small buckets make many of them, with boundaries that differ between a slot's layout and another's.
    bucket_size = draw(st.sampled_from([None, 700, 3000])) if overlap else None
    return Case(
        tp_base=tp_base, dp=dp, dead=tuple(sorted(dead)),
        num_layers=draw(st.integers(1, 3)), query_groups=query_groups, heads_per_group=heads_per_group,
        kv_channels=8, hidden_size=draw(st.sampled_from([24, 32])),
        ffn_hidden_size=draw(st.integers(max(tp_base, 37), 70)), vocab_size=draw(st.sampled_from(VOCABS)),
        position=draw(st.sampled_from(["learned_absolute", "rope"])),
        normalization=draw(st.sampled_from(["LayerNorm", "RMSNorm"])), untie=draw(st.booleans()),
        activation=activation, overlap=overlap, bucket_size=bucket_size,
        clip_grad=draw(st.sampled_from([0.05, 1.0])), micro_batches=draw(st.integers(1, 2)), dist_opt=dist_opt,
        instances=instances,
    )


# -- the fixed examples -----------------------------------------------------------------------------------------

# The worked example of docs/ntp.md (TP4 + TP4, replica 1 lost slot 3) with overlap and small, layout-dependent
# buckets; and a case that loses two slots of one replica with an uneven head split and GQA, under the distributed
# optimizer with two instances (each replica one: the degraded replica's shadows twin the healthy replica's ranks).
WORKED = Case(tp_base=4, dp=2, dead=((1, 3),), num_layers=2, query_groups=8, heads_per_group=1, kv_channels=8,
              hidden_size=32, ffn_hidden_size=64, vocab_size=263, position="learned_absolute",
              normalization="LayerNorm", untie=False, activation="gelu", overlap=True, bucket_size=700,
              clip_grad=0.05, micro_batches=2)
UNEVEN = Case(tp_base=4, dp=2, dead=((0, 1), (0, 2)), num_layers=1, query_groups=6, heads_per_group=2,
              kv_channels=8, hidden_size=24, ffn_hidden_size=41, vocab_size=259, position="rope",
              normalization="RMSNorm", untie=True, activation="swiglu", overlap=False, bucket_size=None,
              clip_grad=1.0, micro_batches=1, dist_opt=True, instances=2)
# Three replicas and blocks of unequal size: slots' buckets place the replicated parameters at different
# offsets, where a three-way sum rounds differently; their value must come from one place. Under the distributed
# optimizer (one instance: three replicas), with overlap and small buckets, replica 2 degraded.
THREE_UNEVEN = Case(tp_base=2, dp=3, dead=((2, 1),), num_layers=2, query_groups=3, heads_per_group=2,
                    kv_channels=8, hidden_size=32, ffn_hidden_size=41, vocab_size=263, position="learned_absolute",
                    normalization="LayerNorm", untie=False, activation="squared_relu", overlap=True, bucket_size=3000,
                    clip_grad=1.0, micro_batches=1, dist_opt=True, instances=1)
# Two instances with overlap and small buckets (healthy replicas: on gloo a degraded one refuses overlap with two
# instances), two micro-batches, clipped.
TWO_OVERLAP = Case(tp_base=2, dp=2, dead=(), num_layers=2, query_groups=4, heads_per_group=2, kv_channels=8,
                   hidden_size=32, ffn_hidden_size=50, vocab_size=265, position="learned_absolute",
                   normalization="RMSNorm", untie=False, activation="squared_relu", overlap=True, bucket_size=700,
                   clip_grad=0.05, micro_batches=2, dist_opt=True, instances=2)
# Two instances of two replicas each, so every block's buffer is cut in two positions inside an instance (with
# one replica per instance nothing is cut), the last replica degraded (its proxy's shadow of the dead block
# twins replica 1's rank), blocks of unequal size with four replicas (replicated state from block 0).
CUT_INSTANCES = Case(tp_base=2, dp=4, dead=((3, 1),), num_layers=1, query_groups=3, heads_per_group=1,
                     kv_channels=8, hidden_size=24, ffn_hidden_size=39, vocab_size=269, position="rope",
                     normalization="RMSNorm", untie=True, activation="gelu", overlap=False, bucket_size=None,
                     clip_grad=1.0, micro_batches=1, dist_opt=True, instances=2)
EXAMPLES = (WORKED, UNEVEN, THREE_UNEVEN, TWO_OVERLAP, CUT_INSTANCES)
"""Checked on every suite run. A freshly drawn case that failed is added here (the ``Case(...)`` hypothesis
printed as its falsifying example), so that it is checked on every run from then on."""


# -- comparison --------------------------------------------------------------------------------------------------

def key_bias_rows(key: str, numel: int, case: Case) -> torch.Tensor:
    """The key rows of the QKV bias and of its moments (a mask): their true gradient is exactly zero (softmax ignores a shift shared
    by all keys), so Adam turns round-off noise into steps in any implementation — plain Megatron TP2 vs TP1
    included. They are left out; everything else is compared."""
    mask = torch.zeros(numel, dtype=torch.bool)
    if ".linear_qkv.bias" in key:
        q = case.heads_per_group * case.kv_channels
        mask.view(case.query_groups, q + 2 * case.kv_channels)[:, q:q + case.kv_channels] = True
    return mask


def adam_outliers(key: str, a: torch.Tensor, b: torch.Tensor, reference: dict, largest_step: float) -> torch.Tensor:
    """The few elements of a parameter allowed past the peak tolerance (a mask). Where an element's gradient is a
    sum that nearly cancels, a round-off of 1e-7 in its terms (TP sums partial products in another order than
    TP1 does, and so does plain Megatron-Core at TP2) becomes 1e-3 of the element, and Adam, dividing by the root
    of the second moment, turns it into a visible weight difference. Measured on a drawn case: one word-embedding
    element 4.7e-4 of the tensor's largest entry off, and 1.85e-4 for the same model at a uniform TP2 x 2. So at
    most ``OUTLIER_SHARE`` of a parameter's elements (at least one) may differ by up to ``OUTLIER_STEP`` of the
    largest Adam step; a whole wrong step, or a difference spread over many elements, still fails. The moments
    themselves are compared in full."""
    none = torch.zeros_like(b, dtype=torch.bool)
    if f"{key}.exp_avg" not in reference:
        return none
    diff = (a - b).abs()
    over = diff > PEAK_TOL * b.abs().max()
    if not over.any():
        return none
    allowed = max(1, int(OUTLIER_SHARE * b.numel()))
    assert int(over.sum()) <= allowed, f"{key}: {int(over.sum())} of {b.numel()} elements differ from TP1's"
    worst = float(diff[over].max())
    assert worst <= OUTLIER_STEP * largest_step, (
        f"{key}: an element differs from TP1's by {worst:.2e}, more than {OUTLIER_STEP:g} of an Adam step")
    return over


def iteration_records(result: JobResult) -> dict[int, dict]:
    return {r["iteration"]: r for r in result.records if r.get("kind") == "iteration"}


PLAIN_TIMEOUT_S = 300


@dataclass
class PlainRun:
    """What ``tests/plain_megatron.py`` recorded for a case: every iteration's lm loss, grad norm and lr, the final
    parameters and Adam moments (whole, by name), and the records of the same training at TP1 × DP1 without the
    distributed optimizer (for plain Megatron-Core's own spread between the two layouts)."""

    records: dict[int, dict]
    state: dict
    dp1: dict[int, dict]

    def spread(self) -> dict[str, float]:
        """The worst relative difference of lm loss and grad norm over the iterations between the two layouts."""
        return {key: max(relative_difference(self.records[i][key], self.dp1[i][key]) for i in self.records)
                for key in ("lm_loss", "grad_norm")}


class PlainServer(_Zygote):
    """Client of ``python -m tests.plain_megatron serve``: one process that imported torch and Megatron-Core (never
    ntp-megatron) once and forks a plain Megatron-Core run per request, so that a case does not pay a fresh
    interpreter's imports (tens of seconds on a loaded machine). The client is the zygote's (every answer read with
    a deadline, a run that does not end in time killed with its process group, a server that does not answer
    started again), with a server of its own. It ends with this process (its input closes)."""

    COMMAND = ("-m", "tests.plain_megatron", "serve")
    START_S = 180.0
    """Bound on the server's imports (its first answer) and on collecting a killed run's exit."""
    _proc: Optional[subprocess.Popen] = None  # its own server, never the zygote
    _lines = None


def run_plain(case: Case, out_dir: Path) -> PlainRun:
    """Plain Megatron-Core at TP1 × DP ``dp`` (:meth:`Case.plain_args`), then at TP1 × DP1 in the same run
    (:class:`PlainServer`: a process that never imports ntp-megatron; the run asserts so)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    records, state, dp1 = out_dir / "records.json", out_dir / "state.pt", out_dir / "dp1.json"
    stdout, stderr = out_dir / "plain_megatron.stdout", out_dir / "plain_megatron.stderr"
    returncode = PlainServer.run(["train", *case.plain_args(), "--save-at", "0", "--ckpt", str(out_dir / "unused"),
                                  "--out", str(records), "--state", str(state), "--spread", str(dp1)],
                                 stdout, stderr, PLAIN_TIMEOUT_S)
    assert returncode == 0, f"plain Megatron-Core failed ({returncode}):\n{stderr.read_text(errors='replace')[-4000:]}"

    def read(path: Path) -> dict[int, dict]:
        return {int(i): r for i, r in json.loads(path.read_text()).items()}

    return PlainRun(read(records), torch.load(state), read(dp1))


def compare_with_plain(case: Case, ntp: JobResult, plain: PlainRun) -> dict:
    """Assert the NTP run computes plain Megatron-Core TP1's function; return the worst differences seen."""
    return compare_runs(case, iteration_records(ntp), torch.load(ntp.run_dir / "state" / "replica0.pt"),
                        plain.records, plain.state)


def compare_runs(case: Case, got: dict[int, dict], state: dict, want: dict[int, dict], reference: dict) -> dict:
    """Per iteration (``lm_loss``, ``grad_norm``, ``lr`` records) and final state (parameters and Adam moments,
    whole, by parameter name): the NTP run against a TP1 reference; the worst differences seen."""
    assert sorted(got) == sorted(want) == list(range(1, ITERS + 1)), (sorted(got), sorted(want))
    worst = {"loss": 0.0, "grad_norm": 0.0, "l2": 0.0, "peak": 0.0}
    for i, record in want.items():
        assert got[i]["tp_per_replica"] == case.widths, got[i]["tp_per_replica"]
        for key, name in (("lm_loss", "loss"), ("grad_norm", "grad_norm")):
            diff = relative_difference(got[i][key], record[key])
            worst[name] = max(worst[name], diff)
            assert diff <= TOL, f"iteration {i}: {key} {got[i][key]!r} vs TP1 {record[key]!r} ({diff:.2e})"
    assert set(state) == set(reference) and any(k.endswith("exp_avg_sq") for k in reference)
    largest_step = sum(record["lr"] for record in want.values())
    for key, expected in reference.items():
        keep = ~key_bias_rows(key, expected.numel(), case)
        a, b = state[key].reshape(-1)[keep], expected.reshape(-1)[keep]
        keep = ~adam_outliers(key, a, b, reference, largest_step)
        a, b = a[keep], b[keep]
        l2 = float((a - b).norm() / b.norm().clamp_min(1e-30))
        peak = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        worst["l2"], worst["peak"] = max(worst["l2"], l2), max(worst["peak"], peak)
        assert l2 <= STATE_TOL and peak <= PEAK_TOL, f"{key} differs from TP1 by {l2:.2e} (L2), {peak:.2e} (peak)"
    return worst


def assert_twins_bitwise(result: JobResult, case: Case, iters: int = ITERS) -> None:
    """After every iteration, the two holders of every optimizer shard (one block and position, one per instance)
    report the same checksum of it; every shard has a holder in each instance; some shard is held by a degraded
    rank's shadow on one side (where the case has dead slots); and the shards change from the first iteration to
    the last."""
    by_iteration: dict[int, dict[tuple[int, int], dict[int, tuple[str, int]]]] = {}
    for record in result.records:
        if record.get("kind") != "state_checksums":
            continue
        for shard in record["shards"]:
            holders = by_iteration.setdefault(record["iteration"], {}).setdefault(
                (shard["block"], shard["position"]), {})
            assert shard["instance"] not in holders, f"two holders of {shard} in one instance"
            holders[shard["instance"]] = (shard["checksum"], record["replica"])
    assert sorted(by_iteration) == list(range(1, iters + 1)), sorted(by_iteration)
    positions = case.dp // case.instances
    degraded = {r for r, width in enumerate(case.widths) if width < case.tp_base}
    for iteration, shards in by_iteration.items():
        assert sorted(shards) == [(b, j) for b in range(case.tp_base) for j in range(positions)], sorted(shards)
        for place, holders in shards.items():
            assert sorted(holders) == list(range(case.instances)), (iteration, place, holders)
            assert len({checksum for checksum, _ in holders.values()}) == 1, (
                f"iteration {iteration}: the twins of shard (block, position) {place} differ: {holders}")
    if degraded:
        assert any(replica in degraded for holders in by_iteration[1].values() for _, replica in holders.values())
    assert by_iteration[1] != by_iteration[iters], "the shards never change"


def clipped(case: Case, ntp: JobResult) -> bool:
    return any(r["grad_norm"] > case.clip_grad for r in iteration_records(ntp).values())
