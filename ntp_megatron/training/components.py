"""The Megatron-Core objects one rank trains with, built for one layout: model (GPTModel in DDP), optimizer,
scheduler, and under NTP the grad sync. Built once at start, and again for a replica whose layout a
re-formation changed (healthy replicas keep theirs; only their process groups are swapped)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from ntp_megatron.config.schema import JobConfig
from ntp_megatron.core.grad_sync import GradSync
from ntp_megatron.core.shadows import Adoptable, release_ddp
from ntp_megatron.patches.optimizer_distrib_optimizer import defer_param_sync
from ntp_megatron.patches.optimizer_grad_norm import set_grad_norm_override
from ntp_megatron.core.unit_moves import adopt_shard_state, point_main_params
from ntp_megatron.training import model as model_lib
from ntp_megatron.training.parallel import ParallelSetup

logger = logging.getLogger(__name__)


@dataclass
class Components:
    setup: ParallelSetup
    tf_config: Any
    model: Any       # megatron.core.distributed.DistributedDataParallel
    optimizer: Any   # megatron.core.optimizer.MegatronOptimizer
    scheduler: OptimizerParamScheduler
    adopted: dict[int, frozenset[int]] = field(default_factory=dict)
    """Block -> the ids of the optimizer's main parameters whose state came by reference from ``adopted_from``,
    with the DDP the block's shadow took over from it (:func:`adoptable`)."""
    adopted_from: Optional["Components"] = None
    """Until :meth:`settle`: the objects whose DDPs these adopted (a hand-back needs their optimizer)."""
    parameters_freed: bool = False
    """The model's parameter storage was given back (``training.memory.free_parameters``): never train these."""

    def param_gather(self) -> None:
        """The collective part of an optimizer step that NTP keeps out of ``optimizer.step()``: the parameter
        all-gather of the distributed optimizer (nothing to do otherwise, and with NTP off upstream's step
        gathers itself)."""
        if self.setup.grad_sync is not None:
            self.setup.grad_sync.param_gather()

    def shard_sources(self) -> list[tuple[int, list]]:
        """Under the distributed optimizer: (block, the Megatron buffers holding this rank's shard of it) for every
        block it serves (:meth:`ntp_megatron.core.grad_sync.GradSync.shard_sources`)."""
        return self.setup.grad_sync.shard_sources()

    def release(self) -> None:
        """Drop what these objects hold beyond themselves (called on objects a re-formation replaced). Their model's
        config may outlive them (the model of a DDP newer objects adopted): its callbacks, which hold the optimizer
        and the grad sync, go."""
        if self.setup.grad_sync is not None:
            self.setup.grad_sync.close()
        release_ddp(self.model, self)
        for name in ("finalize_model_grads_func", "grad_scale_func", "no_sync_func"):
            setattr(self.tf_config, name, None)

    def settle(self) -> None:
        """The formation these objects were built for completed: what they adopted is theirs for good, and nothing
        keeps the objects it came from (or their generation's groups) alive."""
        if self.setup.grad_sync is not None:
            self.setup.grad_sync.settle()
        self.adopted_from = None

    def discard(self) -> None:
        """Drop objects built for a formation that did not complete: the DDPs they adopted go back to the objects
        they came from (bound to those objects' groups, their parameters naming those objects' main copies); the
        rest is released."""
        _hand_back(self.setup.grad_sync, self.adopted_from)
        release_ddp(self.model, self)


def _hand_back(grad_sync: Optional[GradSync], held: Optional["Components"]) -> None:
    """The DDPs ``grad_sync``'s shadows adopted from ``held`` go back to it (and its optimizer's main copies)."""
    if grad_sync is None:
        return
    adopted = grad_sync.adopted_blocks()
    grad_sync.close(hand_back=True)
    for ddp in adopted.values():
        point_main_params(held.optimizer, trained(ddp))
    if adopted:
        logger.info("the formation did not complete: the buffers of blocks %s go back to the objects held before",
                    sorted(adopted))


def trained(ddp) -> list[torch.nn.Parameter]:
    """The parameters of a DDP's module that its buffers hold and the optimizer steps."""
    return [p for p in ddp.module.parameters() if p.requires_grad]


def adoptable(cfg: JobConfig, held: "Components", setup: ParallelSetup) -> dict[int, Adoptable]:
    """Block -> a DDP of ``held`` (the objects the rank trains with now) that its objects for ``setup``'s layout
    take over as their shadow of the block, under the distributed optimizer on a rank of a degraded replica: for
    every block it serves in both layouts at the same shard position, its healthy DDP or its shadow of it, whose
    buffers hold the block's slot-shaped buckets (the same whatever the layout) and its shard of them. The rank
    then never holds the block twice, and its optimizer state moves by reference (:func:`adopt_shard_state`)."""
    if setup.topology is None or not cfg.parallel.use_distributed_optimizer or setup.groups.healthy:
        return {}
    old, new = held.setup.groups, setup.groups
    if (old.instance, old.position) != (new.instance, new.position):
        return {}
    if old.healthy:
        [block] = old.sync
        ddps = {block: held.model}
    else:
        ddps = {block: shadow.ddp for block, shadow in held.setup.grad_sync.shadows.items()}
    return {block: Adoptable(block, ddp, old) for block, ddp in ddps.items() if block in new.sync}


def sharding_groups(cfg: JobConfig, setup: ParallelSetup):
    """The process groups a rank's DDP is built with: the job's collection, except on a healthy NTP rank under the
    distributed optimizer, whose buckets are sharded over its sync group's part in its instance and all-reduced
    across its twins (with one instance: over the whole sync group, as without this). A degraded rank's DDP only
    accumulates (its data-parallel group is itself): its shadows carry the sync groups."""
    if setup.topology is None or not cfg.parallel.use_distributed_optimizer or not setup.groups.healthy:
        return setup.pg
    groups = setup.groups
    [block] = groups.sync
    return groups.with_sync_groups(block)


def optimizer_groups(cfg: JobConfig, setup: ParallelSetup):
    """The process groups the optimizer is built with: its DDP's (:func:`sharding_groups`), or on a degraded NTP rank
    under the distributed optimizer those of its first shadow. Every shadow's buffers shard over their own
    block's group (the optimizer reads each buffer's); the optimizer itself reads from these only its instance
    (the rank in the twins' group, the same for every block) and its position (the same in every block's group:
    members are numbered in replica order)."""
    if (setup.topology is not None and cfg.parallel.use_distributed_optimizer and not setup.groups.healthy):
        return setup.groups.with_sync_groups(next(iter(setup.groups.sync)))
    return sharding_groups(cfg, setup)


def build_optimizer(cfg: JobConfig, tf_config, model, setup: ParallelSetup):
    """Megatron's optimizer over ``model``, or over what the grad sync names (a degraded rank's shadows under the
    distributed optimizer)."""
    t, p = cfg.training, cfg.parallel
    grad_sync = getattr(setup, "grad_sync", None)
    chunks = grad_sync.optimizer_chunks() if grad_sync is not None else [model]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer=t.optimizer, lr=t.lr, sgd_momentum=t.sgd_momentum, min_lr=t.min_lr, weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
            clip_grad=t.clip_grad, bf16=t.precision == "bf16", fp16=t.precision == "fp16",
            params_dtype=tf_config.params_dtype,
            use_distributed_optimizer=p.use_distributed_optimizer,
        ),
        chunks,
        use_gloo_process_groups=False,
        pg_collection=optimizer_groups(cfg, setup),
    )
    if setup.topology is not None and len(getattr(optimizer, "chained_optimizers", [optimizer])) != 1:
        # The norm override returns the global norm; a chain of several would combine it several times.
        raise SystemExit("NTP's grad norm override expects a single optimizer (expert parameters?)")
    carry_ntp_attributes(optimizer)
    if setup.topology is not None and p.use_distributed_optimizer:
        # The step after the commit point must be local: the loop gathers the parameters itself (param_gather).
        defer_param_sync(optimizer)
    # As Megatron-LM's training loop: the schedule scales the loss by the optimizer's loss scale (fp16's
    # dynamic scale; 1 otherwise), and the optimizer unscales the gradients by it.
    tf_config.grad_scale_func = optimizer.scale_loss
    return optimizer


def carry_ntp_attributes(optimizer) -> None:
    """Under bf16 / fp16 the optimizer steps fp32 copies of the model's parameters (main params), to which
    Megatron copies only its own TP attributes; every ``ntp_*`` attribute (``ntp_held_units``: the units a tensor
    holds) goes to them too, so the code that walks the optimizer's tensors — state checksums, unit moves,
    checkpoints — sees their layout."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        for model_group, main_group in zip(getattr(part, "float16_groups", ()),
                                           getattr(part, "fp32_from_float16_groups", ())):
            for param, main_param in zip(model_group, main_group):
                for name, value in vars(param).items():
                    if name.startswith("ntp_"):
                        setattr(main_param, name, value)


def build_scheduler(cfg: JobConfig, optimizer) -> OptimizerParamScheduler:
    t = cfg.training
    samples_per_iter = t.global_batch_size
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=t.lr_warmup_iters * samples_per_iter,
        lr_decay_steps=(t.lr_decay_iters or t.train_iters) * samples_per_iter,
        lr_decay_style=t.lr_decay_style,
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=t.train_iters * samples_per_iter,
        wd_incr_style="constant",
    )


def build_components(cfg: JobConfig, setup: ParallelSetup, device: torch.device,
                     initialize: bool = True, adopt_from: Optional[Components] = None) -> Components:
    """Everything for ``setup``'s layout. ``initialize=False``: weights are left for the caller to fill (a
    re-formation copies them from the old layout and from peers). Under NTP the grad sync comes before the
    optimizer: on a degraded rank under the distributed optimizer it builds the shadows the optimizer steps,
    filled from the model when ``initialize`` (a collective over the replica). ``adopt_from``: the objects the
    rank holds now, whose DDPs the new shadows may take over with their optimizer state (:func:`adoptable`)."""
    tf_config = model_lib.transformer_config(cfg, device)
    healthy = setup.groups is None or setup.groups.healthy
    adopt = adoptable(cfg, adopt_from, setup) if adopt_from is not None else {}
    model = model_lib.build_model(cfg, tf_config, sharding_groups(cfg, setup), device, setup.topology, setup.rank,
                                  own_buckets_sync=healthy, initialize=initialize)
    try:
        if setup.topology is not None:
            _install_grad_sync(cfg, setup, model, tf_config, adopt=adopt, fill=initialize)
        optimizer = build_optimizer(cfg, tf_config, model, setup)
        adopted = {block: adopt_shard_state(optimizer, adopt_from.optimizer, trained(a.ddp))
                   for block, a in adopt.items()}
    except BaseException:  # (an out-of-memory error, say): what was adopted goes back before the error goes on
        if adopt:
            _hand_back(setup.grad_sync, adopt_from)
        raise
    return Components(setup=setup, tf_config=tf_config, model=model, optimizer=optimizer,
                      scheduler=build_scheduler(cfg, optimizer), adopted=adopted,
                      adopted_from=adopt_from if adopted else None)


def attach_grad_sync(cfg: JobConfig, parts: Components) -> None:
    """The NTP grad sync for the current topology and groups (replacing any earlier one), for objects that keep
    their layout across a re-formation."""
    setup = parts.setup
    if cfg.parallel.use_distributed_optimizer and not setup.groups.healthy:
        # Its optimizer steps the shadows of the grad sync it was built with: keeping them across new groups is
        # part of surviving failures live, which the distributed optimizer does not do yet.
        raise RuntimeError("a degraded replica's objects under the distributed optimizer cannot be kept across a "
                           "re-formation yet")
    _install_grad_sync(cfg, setup, parts.model, parts.tf_config)


def _install_grad_sync(cfg: JobConfig, setup: ParallelSetup, model, tf_config,
                       adopt: Optional[dict[int, Adoptable]] = None, fill: bool = True) -> None:
    if setup.grad_sync is not None:
        setup.grad_sync.close()
    setup.grad_sync = GradSync(setup.topology, setup.rank, setup.groups, model, tf_config,
                               model_lib.ddp_config(cfg), adopt=adopt, fill=fill)
    tf_config.finalize_model_grads_func = setup.grad_sync.finalize_model_grads
    set_grad_norm_override(setup.grad_sync.grad_norm)
