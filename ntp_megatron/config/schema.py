"""The training job's YAML schema: sections model / parallel / training / data / ntp / checkpoint / logging.

The ``model`` section uses Megatron-Core's own ``TransformerConfig`` field names so a Megatron user
recognises every key. Every section forbids unknown keys; see :mod:`ntp_megatron.config.files` for the
one-line error format.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Iterable, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ntp_megatron.config.files import ConfigError, load_config
from ntp_megatron.config.timing import TimingSection
from ntp_megatron.plan.layout import make_topology, parse_dead_slots, parse_stage_slots
from ntp_megatron.plan.memory_plan import check_budget
from ntp_megatron.plan.power_curve import boost_model, check_curve_points
from ntp_megatron.plan.stages import JobTopology, make_pipeline_topology

logger = logging.getLogger(__name__)

_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # ntp_megatron/
# The repository's configs/, or its copy in the package (ntp_megatron.configs) when installed from a wheel.
CONFIG_DIR = _PACKAGE_DIR / "configs" if (_PACKAGE_DIR / "configs").is_dir() else _PACKAGE_DIR.parent / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "tiny_cpu.yaml"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)
    # use_attribute_docstrings: each field's docstring is its description, which docs/configuration.md is
    # generated from (python -m ntp_megatron.config.docs).


class ModelSection(_Section):
    """GPT architecture, in Megatron-Core ``TransformerConfig`` / ``GPTModel`` terms."""

    num_layers: int = Field(2, ge=1)
    """Transformer layers."""
    hidden_size: int = Field(64, ge=1)
    """Width of the residual stream."""
    num_attention_heads: int = Field(8, ge=1)
    """Attention heads. Without NTP, they (and the query groups) must be divisible by
    ``parallel.tensor_model_parallel_size``."""
    num_query_groups: Optional[int] = Field(None, ge=1)
    """Grouped-query attention: key/value groups, a divisor of ``num_attention_heads``. null: multi-head
    attention (one group per head). Under NTP a query group with its heads is the unit of the attention family, so
    every TP rank needs at least one."""
    ffn_hidden_size: Optional[int] = Field(None, ge=1)
    """Width of the MLP's hidden layer; null: 4 × ``hidden_size``."""
    kv_channels: Optional[int] = Field(None, ge=1)
    """Channels per attention head; null: ``hidden_size / num_attention_heads`` (which must then divide)."""
    seq_length: int = Field(64, ge=2)
    """Tokens per sample."""
    max_position_embeddings: Optional[int] = Field(None, ge=2)
    """Longest sequence the position embedding covers; null: ``seq_length``."""
    vocab_size: int = Field(256, ge=2)
    """Rows of the word embedding and the output layer; the byte-level tokenizer needs at least 256."""
    hidden_dropout: float = Field(0.1, ge=0.0, le=1.0)
    """Dropout probability on the embeddings and on the outputs of the attention and MLP blocks."""
    attention_dropout: float = Field(0.1, ge=0.0, le=1.0)
    """Dropout probability on the attention weights."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """Normalisation layers."""
    gated_linear_unit: bool = False
    """A gated MLP: fc1 computes gate and up rows (``swiglu`` needs it)."""
    activation: Literal["gelu", "swiglu", "squared_relu"] = "gelu"
    """The MLP's activation; ``swiglu`` needs ``gated_linear_unit: true``."""
    position_embedding_type: Literal["learned_absolute", "rope"] = "learned_absolute"
    """Learned absolute position embeddings, or rotary ones (RoPE)."""
    untie_embeddings_and_output_weights: bool = False
    """Give the output layer its own weight instead of sharing the word embedding's."""
    init_method_std: float = Field(0.02, gt=0.0)
    """Standard deviation of the normal initial weights (scaled by 1/√(2·``num_layers``) for the attention
    projection and fc2, as in Megatron)."""
    layernorm_epsilon: float = Field(1e-5, gt=0.0)
    """Epsilon of every normalisation layer (Megatron's ``--norm-epsilon``)."""
    transformer_impl: Literal["local", "transformer_engine"] = "local"
    """Layer spec: ``local`` is Megatron-Core's local spec (the CPU path, and the one NTP builds on);
    ``transformer_engine`` needs the ``gpu`` extra and ``ntp.enabled: false``."""
    init: Optional[Literal["megatron", "layout_free"]] = None
    """Initial weights: ``layout_free`` (each element a function of seed, parameter name and element index, computed
    for this rank's units only), ``megatron`` (Megatron-Core's own), or null: layout_free under NTP, else megatron.
    ``layout_free`` needs ``transformer_impl: local``."""

    @model_validator(mode="after")
    def _heads(self) -> "ModelSection":
        if self.num_query_groups is not None and self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_query_groups ({self.num_query_groups}) must divide "
                f"model.num_attention_heads ({self.num_attention_heads})"
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.num_attention_heads ({self.num_attention_heads}) must divide "
                f"model.hidden_size ({self.hidden_size}) unless model.kv_channels is set"
            )
        if self.activation == "swiglu" and not self.gated_linear_unit:
            raise ValueError("model.activation 'swiglu' needs model.gated_linear_unit: true")
        if self.init == "layout_free" and self.transformer_impl != "local":
            raise ValueError("model.init 'layout_free' needs model.transformer_impl: local (it knows the local "
                             "spec's parameters); use model.init: megatron with transformer_engine")
        return self


class ParallelSection(_Section):
    """How the ranks are laid out: tensor × data × pipeline parallel (context and expert parallelism are 1)."""

    tensor_model_parallel_size: int = Field(1, ge=1)
    """TP degree of a healthy replica (under NTP, its slots: tp_base)."""
    pipeline_model_parallel_size: int = Field(1, ge=1)
    """Pipeline stages (Megatron's ``--pipeline-model-parallel-size``): the layers are cut into this many stages of
    ``model.num_layers / pipeline_model_parallel_size`` consecutive layers, run by Megatron-Core's 1F1B schedule.
    Ranks are numbered as Megatron numbers them (TP fastest, then data parallel, then stage). Under NTP each stage
    of a replica has its own TP degree (``ntp.dead_slots`` entries ``replica:slot@stage``); it needs
    ``model.init: layout_free``, and no distributed optimizer or overlap yet."""
    data_parallel_size: int = Field(1, ge=1)
    """Replicas. The job starts tensor × data parallel size ranks, less the slots of ``ntp.dead_slots`` and
    ``ntp.dropped_replicas``."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """``auto``: NCCL when CUDA is available, gloo otherwise."""
    timeout_s: float = Field(120.0, gt=0.0)
    """Bound on every collective and store wait, so nothing hangs."""
    overlap_grad_reduce: bool = False
    """Megatron DDP's overlap: a gradient bucket's all-reduce starts during backward once the bucket is
    ready (bucket groups are dispatched in creation order: see patches/README.md)."""
    ddp_bucket_size: Optional[int] = Field(None, ge=1)
    """Elements per DDP gradient bucket (Megatron's ``--ddp-bucket-size``); null: Megatron's default."""
    use_distributed_optimizer: bool = False
    """Megatron's distributed optimizer (optimizer state sharded over the data-parallel group). Under NTP it
    shards each sync group's buckets over the replicas, degraded ones (``ntp.dead_slots``) included, and saves and
    loads checkpoints in any of them. A live failure re-forms (with two instances the dead rank's shard comes
    from its twin); a lost shard goes to ``ntp.on_unrecoverable``, and no replica is dropped live."""
    num_distributed_optimizer_instances: Optional[int] = Field(None, ge=1)
    """Megatron's partial distributed optimizer (``--num-distributed-optimizer-instances``): the replicas form
    this many instances of consecutive replica indices; the optimizer state is sharded inside each instance and
    gradients are all-reduced across them, so every shard is held once per instance. It must divide
    ``data_parallel_size``; above 1 it needs ``use_distributed_optimizer``. null: 2 under NTP with the
    distributed optimizer when ``data_parallel_size`` is even (a dead rank's shard then lives on in its twin),
    else 1. At 1 under NTP with the distributed optimizer a failure loses a shard, which only a checkpoint
    restores (a warning says so)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (needs Transformer Engine or Apex norms); needs ``ntp.enabled: false``."""

    @property
    def world_size(self) -> int:
        return self.tensor_model_parallel_size * self.data_parallel_size * self.pipeline_model_parallel_size


class TrainingSection(_Section):
    """Iterations, batches, optimizer, learning-rate schedule, precision, device and evaluation."""

    train_iters: int = Field(50, ge=1)
    """Iterations to train; a resumed run goes on until this iteration."""
    micro_batch_size: int = Field(4, ge=1)
    """Samples per micro-batch of one replica."""
    global_batch_size: int = Field(16, ge=1)
    """Samples per iteration over all replicas: a multiple of ``micro_batch_size`` ×
    ``parallel.data_parallel_size``. Degraded and dropped replicas do not change it (unless
    ``ntp.degraded_batch: proportional``)."""
    seed: int = Field(1234, ge=0)
    """Seeds the data order, the initial weights and dropout."""
    optimizer: Literal["adam", "sgd"] = "adam"
    """Megatron-Core's optimizer: Adam or SGD."""
    lr: float = Field(1e-3, gt=0.0)
    """Peak learning rate, reached at the end of the warmup."""
    min_lr: float = Field(1e-4, ge=0.0)
    """Learning rate at the end of the decay."""
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root"] = "cosine"
    """How Megatron's ``OptimizerParamScheduler`` decays the learning rate from ``lr`` to ``min_lr``."""
    lr_warmup_iters: int = Field(5, ge=0)
    """Iterations of linear warmup from 0 to ``lr``; must be below the decay length."""
    lr_decay_iters: Optional[int] = Field(None, ge=1)
    """Iterations over which the learning rate decays; null: ``train_iters``."""
    weight_decay: float = Field(0.01, ge=0.0)
    """Weight decay, constant over the run."""
    adam_beta1: float = Field(0.9, gt=0.0, lt=1.0)
    """Adam's β1."""
    adam_beta2: float = Field(0.95, gt=0.0, lt=1.0)
    """Adam's β2."""
    adam_eps: float = Field(1e-8, gt=0.0)
    """Adam's ε."""
    sgd_momentum: float = Field(0.9, ge=0.0, lt=1.0)
    """Momentum of ``optimizer: sgd``."""
    clip_grad: float = Field(1.0, ge=0.0)
    """Clip gradients to this global L2 norm; 0: no clipping."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """``bf16`` and ``fp16`` train with Megatron's mixed-precision optimizer (fp32 main params); ``fp16``
    (dynamic loss scale) needs ``ntp.enabled: false``."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: CUDA when a usable GPU is present, else the CPU (a GPU machine whose CUDA is broken stops
    with a message instead of training on the CPU); ``cuda`` is refused on a machine without CUDA."""
    eval_interval: Optional[int] = Field(None, ge=0)
    """Megatron's ``--eval-interval``: evaluate on the validation split after every ``eval_interval`` iterations,
    and once more at the end of training (validation, and test where ``data.split`` gives test data; an interval
    above ``train_iters`` gives the final evaluation only). null or 0: no evaluation (Megatron-LM evaluates every
    1000 iterations by default; here evaluation is opt-in)."""
    eval_iters: int = Field(100, ge=0)
    """Megatron's ``--eval-iters``: batches of ``global_batch_size`` samples per evaluation (0: no evaluation)."""

    @property
    def evaluates(self) -> bool:
        return bool(self.eval_interval) and self.eval_iters > 0


def split_fractions(split: str) -> list[float]:
    """``data.split`` as Megatron reads it ("98,2,0", "98/2/0"; missing parts are 0): train, validation, test
    fractions."""
    parts = [float(x) for x in re.findall(r"[.0-9]+", split)]
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [x / total for x in parts] if total > 0 else parts


class DataSection(_Section):
    """``mock: true`` uses Megatron-Core's MockGPTDataset; otherwise ``data_path`` names indexed data."""

    mock: bool = True
    """Megatron-Core's ``MockGPTDataset`` (synthetic documents, nothing read); false: the indexed data of
    ``data_path`` (``--data-path`` sets it false)."""
    data_path: list[str] = Field(default_factory=list)
    """A blend like Megatron's ``--data-path``: ``[prefix]`` or ``[weight, prefix, weight, prefix, ...]``; needed
    when ``mock`` is false."""
    split: str = "100,0,0"
    """Megatron's ``--split``: train, validation and test shares of the documents, up to three non-negative numbers
    with a positive sum (validation and test are read by the evaluation, ``training.eval_interval``). Mock data
    ignores it: Megatron-Core splits mock documents 1,1,1."""
    tokenizer: Literal["byte-level"] = "byte-level"
    """Byte-level, the only tokenizer: it needs no vocabulary file, so nothing is downloaded at run time."""
    cache_dir: Optional[str] = None
    """Where Megatron's dataset index caches go; default: ``<run_dir>/data_cache``."""

    @model_validator(mode="after")
    def _path(self) -> "DataSection":
        if not self.mock and not self.data_path:
            raise ValueError("data.data_path must name a preprocessed prefix when data.mock is false")
        if len(re.findall(r"[.0-9]+", self.split)) > 3 or not sum(split_fractions(self.split)):
            raise ValueError(f"data.split '{self.split}' must be up to three non-negative shares (train, validation, "
                             "test) with a positive sum, e.g. 98,2,0")
        return self


class NTPSection(_Section):
    """Nonuniform tensor parallelism and live failures (docs/live-failures.md)."""

    enabled: bool = True
    """Nonuniform tensor parallelism: a replica that loses a rank re-forms at a lower TP degree and trains on. Off:
    plain Megatron-Core behaviour (a failure restarts the job from the last checkpoint, or ends it)."""
    min_tp: int = Field(1, ge=1)
    """No replica may run narrower: a failure that would leave one below it is handled by
    ``on_unrecoverable``."""
    dead_slots: list[str] = Field(default_factory=list)
    """Start degraded: ``"replica:slot"`` entries whose process is not started, e.g. ``[1:3]``; with pipeline stages
    ``"replica:slot@stage"`` (``@0`` when omitted), e.g. ``[1:3@1]``."""
    dropped_replicas: list[int] = Field(default_factory=list)
    """Start without these replicas (none of their processes is started); their shares of every global batch go
    to the others, as after ``on_unrecoverable: drop_replica``. A ``restart`` sets it."""
    degraded_batch: Literal["full", "proportional"] = "full"
    """``full``: every replica processes the same local batch. ``proportional``: a replica at width w of
    tp_base processes about w/tp_base of its micro-batches; gradients are averaged over the samples processed."""
    on_unrecoverable: Literal["drop_replica", "stop", "restart"] = "drop_replica"
    """A failure NTP cannot absorb in place — a replica loses every rank or falls below ``min_tp``:
    ``drop_replica`` trains on without it (its share of the global batch goes to the other replicas, so the
    global batch and the data order do not change); ``stop`` ends the run with a clear message and exit 1;
    ``restart`` stops every rank and starts the job again from the newest checkpoint of ``checkpoint.save`` with
    fresh processes for the surviving slots: each replica with its live slots, replicas below ``min_tp`` dropped
    (``dropped_replicas``), the global batch unchanged (at most ``checkpoint.max_restarts`` times). Under
    ``parallel.use_distributed_optimizer`` a failure that leaves an optimizer shard without a holder (both twins;
    with one instance, any failure) is one NTP cannot absorb too, and no replica is dropped live (``drop_replica``
    stops there)."""
    heartbeat_interval_s: float = Field(0.2, gt=0.0)
    """How often every rank tells the launcher it is alive."""
    heartbeat_timeout_s: float = Field(10.0, gt=0.0)
    """A rank whose heartbeat is this old (stuck so hard its heartbeat thread cannot run) is fenced: SIGKILLed,
    then handled as dead. A stopped process (SIGSTOP) is fenced within half a second regardless; with
    ``progress_fence`` (the default) a rank whose heartbeat goes on but that holds its peers up without progress is
    fenced at half of this (``timing.stall_fraction``). The heartbeat is a Python thread that long GIL-holding work
    can delay by seconds: keep this well above that."""
    node_timeout_s: float = Field(30.0, gt=0.0)
    """A node silent this long counts as lost: one whose launcher (on node 0: whose store) cannot be reached, or whose
    heartbeat in node 0's store is this old. A launcher of another node that cannot reach node 0's store for this long
    stops its ranks and exits 1 with one line naming it (its ranks cannot go on without node 0's controller). At least
    ``heartbeat_timeout_s``: a node is given as long as a rank before it counts as gone."""
    progress_fence: bool = True
    """Also fence a rank whose heartbeat goes on but which holds its peers up: a rank has waited on its peers for
    half of ``heartbeat_timeout_s`` (``timing.stall_fraction``), and this one is a member of a group it waits in that
    has entered fewer collectives there, makes no progress for as long (marks per layer in forward and backward, per
    parameter in the optimizer step, per collective and per phase), does not wait itself and is in a phase of an
    iteration (start to param_gather): stuck in a kernel (``--inject-failure spin:...``). Causal: a
    rank frozen elsewhere is not fenced for this wait, a slow rank that progresses never is. On gloo and NCCL
    (``collective_sequences``). false: fence by heartbeat only (a rank stuck with its heartbeat alive then holds its
    peers until ``parallel.timeout_s``)."""
    collective_sequences: Literal["auto", "torch", "flight_recorder"] = "auto"
    """Where each rank's collective sequence numbers per group, and what it waits on, come from (``progress_fence``):
    ``torch``, torch's per-group sequence number and the host's waits (right on gloo, where a wait blocks the host);
    ``flight_recorder``, torch's flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``, ``TORCH_NCCL_ENABLE_TIMING``):
    the collectives each group's device started and completed (right on NCCL, where a wait does not block the
    host; on gloo it records no start and falls back to ``torch``'s counts); ``auto``, the flight recorder on NCCL
    and ``torch`` otherwise."""
    keep_groups: bool = True
    """A re-formation keeps the process groups it did not touch (a healthy replica's tensor-parallel group, the sync
    groups whose members did not change), the same objects and communicators, where their members agree nothing is
    left half-matched in them; only the others are made anew. false: every rank makes every group anew in every
    generation (what ntp-megatron did before; for comparison, ``scripts/bench.sh --only recovery``)."""
    rejoin_after_s: Optional[float] = Field(None, ge=0.0)
    """Seconds after a rank's failure (the repair delay) until the launcher starts a replacement process for its
    slot; it is admitted at an iteration boundary and takes its canonical block back. null: never."""
    max_rejoin_attempts: int = Field(3, ge=1)
    """At most this many replacements in a row per slot: one that dies while starting or being admitted is followed
    by another until this many have been started (the count starts over once one is admitted)."""
    memory_budget_gib: Optional[float] = Field(None, gt=0.0)
    """Per-device budget, in GiB, for one rank's training state: parameters, gradient buffers, optimizer state, and
    on a rank of a degraded replica the shadow buffers of the blocks it syncs (activations and caches are not
    counted). A ``min_tp`` that would let a rank exceed it in some layout is refused before the start, naming the
    lowest ``min_tp`` that fits (``ntp-launch --print-memory-plan`` prints every TP degree's figure). null: no
    check."""
    rebalance: bool = True
    """A slow rank gets a smaller share live (docs/live-failures.md, slow ranks): when a rank's compute time per
    iteration stays more than ``rebalance_threshold`` times its tensor-parallel group's median for
    ``rebalance_window`` iterations, the controller publishes a generation in which it holds a share of the units in
    proportion to its speed (the others of its replica take the rest; nothing else changes), and gives its units
    back once it is as fast as the others again. false: a slow rank slows its whole replica, and the job."""
    rebalance_threshold: float = Field(1.2, gt=1.0)
    """How much slower than its group's median (compute time per iteration, waits excluded) a rank must stay to be
    rebalanced; a rebalanced rank gets its units back once it is this much faster than the median."""
    rebalance_window: int = Field(10, ge=1)
    """For how many consecutive iterations a rank must stay that slow (or that fast) before its replica is
    rebalanced."""
    emulated_device_ms: Optional[float] = Field(None, gt=0.0)
    """CPU tests and benchmarks: every rank also computes on an emulated device, sleeping its share (the fraction of
    its replica's tensor-parallel weights it holds) of this many milliseconds at each micro-batch of a training
    iteration, so that ranks wait on a slow peer as GPUs do instead of sharing the CPU with it
    (:mod:`ntp_megatron.speed.device_model`). null: off (the real compute only)."""
    boost: bool = False
    """Power boost (docs/live-failures.md, power boost): every rank of a degraded or rebalanced replica draws the power
    that lets it keep a healthy replica's pace (its work over a healthy rank's, over its speed, on the
    power-performance curve ``boost_alpha`` / ``boost_points``), at most ``boost_max_power`` x its default limit,
    through NVML (the gpu extra's pynvml); the default is restored when its replica heals and at the end. Without a
    GPU, pynvml or NVML's permission: a dry run that records what it would set (``boost`` events)."""
    boost_max_power: float = Field(1.3, ge=1.0, le=3.0)
    """The power cap of a boosted GPU, x its default power limit (the goodput simulator's
    ``strategies.boost.max_power``)."""
    boost_alpha: float = Field(0.58, gt=0.0, le=1.0)
    """The power-performance curve ``performance = power ** alpha`` (powers and performance x nominal; 0.58: B200 at
    1,000 W and 1,200 W, as the simulator's default). Unused when ``boost_points`` is given."""
    boost_points: Optional[list[list[float]]] = None
    """A measured curve instead: ``[[power, performance], ...]`` (x nominal), increasing, performance 1 at power 1;
    interpolated, held past its ends."""
    boost_dry_run: bool = False
    """Record what power boost would set, and set nothing, even where NVML could."""
    warm_spares: int = Field(0, ge=0)
    """Warm spares per node, used when ``rejoin_after_s`` is set: processes started with the ranks (imports done,
    device not yet chosen) that wait to become a failed rank's replacement, so a rejoin does not wait for a fresh
    interpreter to boot (seconds on CPU, more with CUDA). A replacement is a spare of the failed rank's own node
    when one is idle, else a fresh process; each spare used is replaced by a new one for the next failure. 0: every
    replacement is a fresh process."""


    @model_validator(mode="after")
    def _boost_curve(self) -> "NTPSection":
        if self.boost_points is not None:
            try:
                check_curve_points(self.boost_points, "ntp.boost_points")
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        return self

    def boost_model(self):
        """The power-performance curve and cap (:func:`ntp_megatron.plan.power_curve.boost_model`)."""
        return boost_model(self.boost_max_power, self.boost_alpha, self.boost_points)


class CheckpointSection(_Section):
    """Megatron-Core ``dist_checkpointing`` saves and loads, in any topology (docs/checkpoints.md)."""

    save: Optional[str] = None
    """Directory to save dist_checkpointing checkpoints into (``iter_0000010/`` per save)."""
    save_interval: Optional[int] = Field(None, ge=1)
    """Iterations between saves; null: only the final checkpoint, which is saved at the end whenever
    ``save`` is set."""
    load: Optional[str] = None
    """Directory to resume from: the checkpoint its ``latest_checkpointed_iteration.txt`` names (an iteration, or
    ``release``), or one checkpoint directory (``iter_*``, ``release``; the launcher pins it to that one for the
    run). Any layout reads it: another topology, NTP on or off, a plain Megatron-Core checkpoint, model weights
    alone (a model-only or ``release`` checkpoint starts the run at iteration 0 with fresh optimizer and scheduler
    state, and says so)."""
    finetune: bool = False
    """Megatron's ``--finetune``: load only the model weights of ``load``; the run starts at iteration 0 with no
    samples consumed and fresh optimizer, scheduler and RNG state. The launcher sets it for a checkpoint that
    holds no iteration; a restart from the run's own ``save`` loads everything."""
    no_load_optim: bool = False
    """Megatron's ``--no-load-optim``: keep the checkpoint's iteration and consumed samples, start the optimizer
    and the learning-rate scheduler fresh (as Megatron-LM: the schedule starts again from its warmup). The
    launcher sets it for a checkpoint that holds no optimizer state."""
    no_load_rng: bool = False
    """Megatron's ``--no-load-rng``: do not restore the RNG streams (they start from ``training.seed``). The
    launcher sets it for a checkpoint that holds none."""
    async_save: bool = False
    """Write checkpoints in the background with Megatron-Core's async path (``dist_checkpointing.save(...,
    async_sharded_save=True)`` scheduled on its ``AsyncCallsQueue``): each rank forks a writer whose memory is a
    copy-on-write snapshot of the state at the save iteration, and training goes on while it writes.
    ``latest_checkpointed_iteration.txt`` moves to the new checkpoint only once every rank's writer has finished
    (checked at the end of each later iteration, and before the next save and the end of the run). NTP off
    only for now (refused with ``ntp.enabled``); ignored without ``save``."""
    max_restarts: int = Field(3, ge=0)
    """With NTP off and ``save`` set (or NTP on with ``ntp.on_unrecoverable: restart``): how many times a failure
    restarts the whole job from the last checkpoint before the run ends with an error."""


class LoggingSection(_Section):
    """Log lines, the metrics file, TensorBoard, and verification and measurement aids (docs/metrics.md)."""

    log_interval: int = Field(1, ge=1)
    """Print an iteration line every this many iterations (and at the last one); the metrics file records
    every iteration."""
    tensorboard_dir: Optional[str] = None
    """Default: ``<run_dir>/tensorboard/<start time>`` (one subdirectory per run); the empty string: off."""
    run_dir: str = "runs/latest"
    """Where a run writes its outputs (metrics, TensorBoard, ``run.png``, rank pids), relative to the current
    directory; ``--run-dir`` sets it."""
    metrics_file: Optional[str] = None
    """JSON lines, one per iteration and event, appended to. Default: ``<run_dir>/metrics.jsonl``; the empty
    string: none."""
    state_checksums: bool = False
    """Verification aid: after every iteration each replica reports checksums of its full parameters and
    optimizer state (a ``state_checksums`` record in the metrics file). Costs a gather per tensor."""
    dump_state: Optional[str] = None
    """Verification aid: each replica saves its full parameters and optimizer state to
    ``<dump_state>/replica<r>.init.pt`` before the first step and ``<dump_state>/replica<r>.pt`` at the end."""
    comm_stats: bool = False
    """Measurement aid: every rank reports, per iteration, its torch.distributed calls and their payload
    bytes (a ``comm_stats`` record in the metrics file; see ``scripts/bench.sh``)."""


class FaultsSection(_Section):
    """Injected failures (docs/faults.md)."""

    inject: list[str] = Field(default_factory=list)
    """``--inject-failure`` specs (see ``ntp_megatron.faults``); ``--inject-failure`` on the command line
    replaces this list."""


class JobConfig(_Section):
    """A training job: one section per concern.

    Rules between keys of different sections (each broken one is a one-line error):

    - ``training.global_batch_size`` is a multiple of ``training.micro_batch_size`` × ``parallel.data_parallel_size``;
    - with ``ntp.enabled``: no ``parallel.sequence_parallel`` or ``training.precision: fp16``; with
      ``parallel.use_distributed_optimizer``, no ``ntp.dropped_replicas`` unless it has one instance
      (``parallel.num_distributed_optimizer_instances``); ``model.transformer_impl:
      local``; the starting topology is valid (dead slots inside the grid, no replica below ``ntp.min_tp``, at least
      ``parallel.tensor_model_parallel_size`` units in every family: query groups, FFN units, vocabulary rows); no
      ``checkpoint.async_save``;
    - without NTP: no ``ntp.dead_slots`` or ``ntp.dropped_replicas``, and ``model.num_attention_heads`` and the
      query groups divisible by ``parallel.tensor_model_parallel_size``;
    - ``training.lr_warmup_iters`` below the decay length (``training.lr_decay_iters``, else ``train_iters``);
    - evaluation on indexed data needs a validation share in ``data.split``;
    - ``checkpoint.save_interval`` needs ``checkpoint.save``; ``ntp.on_unrecoverable: restart`` needs both;
    - ``parallel.num_distributed_optimizer_instances`` divides ``parallel.data_parallel_size`` and, above 1, needs
      ``parallel.use_distributed_optimizer``;
    - ``ntp.heartbeat_timeout_s`` above ``ntp.heartbeat_interval_s`` and at most ``ntp.node_timeout_s``; ``ntp.min_tp`` at most
      ``parallel.tensor_model_parallel_size``.
    """

    model: ModelSection = Field(default_factory=ModelSection)
    """GPT architecture."""
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    """Tensor and data parallelism, backend, timeouts, DDP."""
    training: TrainingSection = Field(default_factory=TrainingSection)
    """Iterations, batches, optimizer, schedule, precision, device, evaluation."""
    data: DataSection = Field(default_factory=DataSection)
    """Mock or indexed data, split, tokenizer."""
    ntp: NTPSection = Field(default_factory=NTPSection)
    """Nonuniform tensor parallelism and live failures."""
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    """Saving and resuming."""
    logging: LoggingSection = Field(default_factory=LoggingSection)
    """Log lines, metrics, TensorBoard."""
    faults: FaultsSection = Field(default_factory=FaultsSection)
    """Injected failures."""
    timing: TimingSection = Field(default_factory=TimingSection)
    """Grace periods, waits and polls of the launcher and the live path (``ntp_megatron/config/timing.py``)."""

    @model_validator(mode="after")
    def _batch(self) -> "JobConfig":
        t, p, m = self.training, self.parallel, self.model
        per_step = t.micro_batch_size * p.data_parallel_size
        if t.global_batch_size % per_step:
            raise ValueError(
                f"training.global_batch_size ({t.global_batch_size}) must be a multiple of "
                f"training.micro_batch_size × parallel.data_parallel_size ({per_step})"
            )
        tp = p.tensor_model_parallel_size
        groups = m.num_query_groups or m.num_attention_heads
        self._check_pipeline()
        if self.ntp.enabled:
            self._check_ntp()
        elif self.ntp.dead_slots or self.ntp.dropped_replicas:
            key = "ntp.dead_slots" if self.ntp.dead_slots else "ntp.dropped_replicas"
            raise ValueError(f"{key} needs ntp.enabled: true (without NTP a replica cannot run degraded)")
        else:
            for name, value in (("model.num_attention_heads", m.num_attention_heads),
                                ("model.num_query_groups", groups)):
                if value % tp:
                    raise ValueError(
                        f"{name} ({value}) must be divisible by parallel.tensor_model_parallel_size ({tp}) "
                        "without NTP"
                    )
        decay_iters = t.lr_decay_iters or t.train_iters
        if t.lr_warmup_iters >= decay_iters:
            source = "training.lr_decay_iters" if t.lr_decay_iters else "training.train_iters (lr_decay_iters unset)"
            raise ValueError(
                f"training.lr_warmup_iters ({t.lr_warmup_iters}) must be below the decay length, {source} = "
                f"{decay_iters}: shorten the warmup (--lr-warmup-iters {max(decay_iters - 1, 0)}) or lengthen the "
                f"run (--train-iters / --lr-decay-iters above {t.lr_warmup_iters})"
            )
        if t.evaluates and not self.data.mock and split_fractions(self.data.split)[1] == 0:
            raise ValueError(f"data.split '{self.data.split}' has no validation share, but training.eval_iters "
                             f"({t.eval_iters}) and training.eval_interval ({t.eval_interval}) ask for evaluation: "
                             "give it one (e.g. data.split: 98,2,0) or set training.eval_iters: 0")
        if self.checkpoint.save_interval and not self.checkpoint.save:
            raise ValueError("checkpoint.save_interval needs checkpoint.save (a directory)")
        if self.checkpoint.async_save and self.ntp.enabled:
            raise ValueError("checkpoint.async_save is not supported with ntp.enabled yet (a re-formation cannot "
                             "drop a pending background save cleanly): set ntp.enabled: false or "
                             "checkpoint.async_save: false")
        if self.ntp.on_unrecoverable == "restart" and not (self.checkpoint.save and self.checkpoint.save_interval):
            raise ValueError("ntp.on_unrecoverable 'restart' needs checkpoint.save and checkpoint.save_interval "
                             "(the checkpoints it restarts from)")
        if self.ntp.heartbeat_timeout_s <= self.ntp.heartbeat_interval_s:
            raise ValueError(f"ntp.heartbeat_timeout_s ({self.ntp.heartbeat_timeout_s}) must exceed "
                             f"ntp.heartbeat_interval_s ({self.ntp.heartbeat_interval_s})")
        if self.ntp.node_timeout_s < self.ntp.heartbeat_timeout_s:
            raise ValueError(f"ntp.node_timeout_s ({self.ntp.node_timeout_s}) must be at least "
                             f"ntp.heartbeat_timeout_s ({self.ntp.heartbeat_timeout_s}): a node is given as long as a "
                             "rank before it counts as gone")
        if self.ntp.min_tp > tp:
            raise ValueError(f"ntp.min_tp ({self.ntp.min_tp}) must be ≤ parallel.tensor_model_parallel_size ({tp})")
        return self

    @model_validator(mode="after")
    def _distributed_optimizer_instances(self) -> "JobConfig":
        """Resolve ``parallel.num_distributed_optimizer_instances`` (null: its default) and check it."""
        p = self.parallel
        k = distributed_optimizer_instances(p.num_distributed_optimizer_instances, ntp=self.ntp.enabled,
                                            distributed_optimizer=p.use_distributed_optimizer,
                                            data_parallel_size=p.data_parallel_size)
        if p.num_distributed_optimizer_instances != k:
            p.num_distributed_optimizer_instances = k
        # gloo, or maybe (auto: gloo where there is no CUDA, which the configuration does not know)
        gloo = p.backend == "gloo" or (p.backend == "auto" and self.training.device != "cuda")
        if self.ntp.enabled and k > 1 and p.overlap_grad_reduce and gloo and _warn_once("overlap on gloo"):
            # grad_sync.GradSync refuses the layout once a replica is degraded (the deadlock is described there).
            logger.warning("parallel.overlap_grad_reduce with %d distributed-optimizer instances cannot train a "
                           "degraded replica if the job runs on gloo (CPU): the first failure would end the run (a "
                           "healthy rank's gradient sync waits in its backward hooks for the degraded replica); set "
                           "parallel.overlap_grad_reduce: false to survive failures there", k)
        return self

    @model_validator(mode="after")
    def _memory_budget(self) -> "JobConfig":
        """``ntp.memory_budget_gib`` against the plan (after the instance count is resolved: it sets the shards)."""
        if self.ntp.enabled:
            check_budget(self)
        return self

    def _check_pipeline(self) -> None:
        pp, m = self.parallel.pipeline_model_parallel_size, self.model
        if pp == 1:
            return
        if m.num_layers % pp:
            allowed = ", ".join(str(d) for d in range(1, m.num_layers + 1) if m.num_layers % d == 0)
            raise ValueError(f"parallel.pipeline_model_parallel_size ({pp}) must divide model.num_layers "
                             f"({m.num_layers}): allowed {allowed}")
        if self.parallel.sequence_parallel:
            raise ValueError("parallel.sequence_parallel is not supported with parallel.pipeline_model_parallel_size "
                             f"({pp}) above 1 yet; switch one of them off")
        if not self.ntp.enabled:
            return
        key = f"with ntp.enabled and parallel.pipeline_model_parallel_size {pp}"
        if self.parallel.use_distributed_optimizer:
            raise ValueError(f"parallel.use_distributed_optimizer is not supported {key} yet: set it to false")
        if self.parallel.overlap_grad_reduce:
            raise ValueError(f"parallel.overlap_grad_reduce is not supported {key} yet: set it to false")
        if self.ntp.degraded_batch != "full":
            raise ValueError(f"ntp.degraded_batch '{self.ntp.degraded_batch}' is not supported {key} (every stage of "
                             "a replica runs the same micro-batches): use 'full'")
        if self.initializer != "layout_free":
            raise ValueError(f"model.init '{self.initializer}' is not supported {key}: use layout_free (a stage "
                             "cannot replay the random draws of the stages before it)")

    def _check_ntp(self) -> None:
        if self.parallel.sequence_parallel:
            raise ValueError("parallel.sequence_parallel is not supported with ntp.enabled yet; switch one of them off")
        p = self.parallel
        if p.use_distributed_optimizer and self.ntp.dropped_replicas:
            k = distributed_optimizer_instances(p.num_distributed_optimizer_instances, ntp=True,
                                                distributed_optimizer=True, data_parallel_size=p.data_parallel_size)
            if k != 1:
                # Instances are fixed blocks of launch replicas: one that lost a replica has shards with no twin,
                # and Megatron's partial distributed optimizer needs instances of one size.
                raise ValueError(f"ntp.dropped_replicas ({self.ntp.dropped_replicas}) needs "
                                 "parallel.num_distributed_optimizer_instances: 1 with "
                                 f"parallel.use_distributed_optimizer (not {k}: an instance would lack a replica)")
        if self.training.precision == "fp16":
            raise ValueError("training.precision 'fp16' is not supported with ntp.enabled yet (its loss scaler "
                             "reduces over the replica inside the optimizer step, after the commit point): use "
                             "'bf16' or 'fp32', or set ntp.enabled: false")
        if self.model.transformer_impl != "local":
            raise ValueError("ntp.enabled needs model.transformer_impl: local (NTP layers build on the local spec)")
        try:
            self.topology()
        except ValueError as exc:  # dead slot out of range, replica below min_tp, fewer units than TP ranks
            message = str(exc)
            raise ValueError(message if message.startswith("ntp.") else f"ntp topology: {message}") from None

    def unit_counts(self) -> dict[str, int]:
        """Units per TP-split family: query groups (heads under MHA), FFN hidden units, vocabulary rows."""
        m = self.model
        return {
            "heads": m.num_query_groups or m.num_attention_heads,
            "ffn": m.ffn_hidden_size or 4 * m.hidden_size,
            "vocab": m.vocab_size,
        }

    def topology(self):
        """The starting NTP topology (generation 0), a :class:`ntp_megatron.plan.stages.JobTopology` (of one stage
        without pipeline stages); pure, so the launcher and the tests can call it."""
        p = self.parallel
        if p.pipeline_model_parallel_size > 1:
            return make_pipeline_topology(
                p.tensor_model_parallel_size, p.data_parallel_size, p.pipeline_model_parallel_size, self.unit_counts(),
                dead_slots=parse_stage_slots(self.ntp.dead_slots), min_tp=self.ntp.min_tp,
                dropped=self.ntp.dropped_replicas)
        return JobTopology.one_stage(make_topology(
            p.tensor_model_parallel_size, p.data_parallel_size, self.unit_counts(),
            dead_slots=parse_dead_slots(self.ntp.dead_slots), min_tp=self.ntp.min_tp,
            dropped=self.ntp.dropped_replicas,
        ))

    @property
    def initializer(self) -> str:
        """``model.init``, its default resolved: the layout-free initialiser under NTP, Megatron's own otherwise."""
        return self.model.init or ("layout_free" if self.ntp.enabled else "megatron")

    @property
    def world_size(self) -> int:
        """Ranks to start: tensor × data parallel size, less the dead slots of a degraded start."""
        return self.topology().world_size if self.ntp.enabled else self.parallel.world_size

    @property
    def num_microbatches(self) -> int:
        return self.training.global_batch_size // (
            self.training.micro_batch_size * self.parallel.data_parallel_size
        )


def distributed_optimizer_instances(requested: Optional[int], *, ntp: bool, distributed_optimizer: bool,
                                    data_parallel_size: int) -> int:
    """``parallel.num_distributed_optimizer_instances`` resolved: ``requested``, or when None its default (2 under
    NTP with the distributed optimizer and an even data-parallel size, else 1). ValueError (one line, naming the
    key and the allowed values) where Megatron would refuse it; a warning where a failure would lose a shard."""
    key, dp = "parallel.num_distributed_optimizer_instances", data_parallel_size
    if requested is None:
        requested = 2 if ntp and distributed_optimizer and dp % 2 == 0 else 1
    if requested > 1 and not distributed_optimizer:
        raise ValueError(f"{key} ({requested}) needs parallel.use_distributed_optimizer: true; without it the only "
                         "allowed value is 1")
    if dp % requested:
        allowed = ", ".join(str(d) for d in range(1, dp + 1) if dp % d == 0)
        raise ValueError(f"{key} ({requested}) must divide parallel.data_parallel_size ({dp}): allowed {allowed}")
    if requested == 1 and ntp and distributed_optimizer and _warn_once(key):
        logger.warning("%s is 1 under NTP with the distributed optimizer: each optimizer shard is held by one rank "
                       "only, so a failure loses it and training needs a checkpoint to go on (2 keeps a twin of "
                       "every shard; it needs an even parallel.data_parallel_size)", key)
    return requested


_WARNED: set[str] = set()


def _warn_once(what: str) -> bool:
    """True the first time ``what`` is asked for in this process: a config is validated more than once."""
    if what in _WARNED:
        return False
    _WARNED.add(what)
    return True


def load_job_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> JobConfig:
    """The job config from ``path`` (default: the tiny CPU demo) with ``--set`` overrides applied."""
    if path is None and not DEFAULT_CONFIG.is_file():  # installed without the repository's configs/
        return load_config(JobConfig, None, overrides)
    return load_config(JobConfig, path if path is not None else DEFAULT_CONFIG, overrides)
