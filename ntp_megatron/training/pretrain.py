"""``ntp-pretrain``: the program each rank runs. Started by ``ntp-launch``, never by hand.

Reads the config the launcher resolved, joins the job through the launcher's store, builds the Megatron-Core
stack (parallel groups, GPTModel, DDP, optimizer, scheduler, datasets) and trains.

Importing this module imports torch and Megatron-Core (seconds of CPU per process): the launcher imports
it once and forks every rank from there, so ranks start without paying it again.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from ntp_megatron.training import runtime

runtime.quiet_optional_dependency_warnings()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402

from ntp_megatron import faults  # noqa: E402
from ntp_megatron.config import JobConfig  # noqa: E402
from ntp_megatron.grad_sync import GradSync  # noqa: E402
from ntp_megatron.patches import apply_patches  # noqa: E402
from ntp_megatron.patches.optimizer_grad_norm import set_grad_norm_override  # noqa: E402
from ntp_megatron.training import checkpoint, data, model as model_lib, parallel  # noqa: E402
from ntp_megatron.training.comm_stats import CommStats  # noqa: E402
from ntp_megatron.training.loop import Trainer  # noqa: E402

def _setup_logging(rank: int) -> None:
    """Warnings from every rank; our own INFO lines from rank 0 only (``NTP_LOG_LEVEL`` overrides both)."""
    level = os.environ.get("NTP_LOG_LEVEL")
    logging.basicConfig(level=level or "WARNING", format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("ntp_megatron").setLevel(level or ("INFO" if rank == 0 else "WARNING"))


def main() -> int:
    env = runtime.RankEnv.from_environ()
    _setup_logging(env.rank)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    cfg = JobConfig.model_validate_json(env.config_path.read_text())
    device = runtime.select_device(cfg.training.device)
    apply_patches(cpu=device.type == "cpu")
    backend = runtime.select_backend(cfg.parallel.backend, device)
    store = runtime.connect_store(env, cfg.parallel.timeout_s)
    runtime.init_process_group(env, store, backend, cfg.parallel.timeout_s)

    p, t = cfg.parallel, cfg.training
    if env.world_size != cfg.world_size:
        raise SystemExit(f"world size {env.world_size} != the {cfg.world_size} ranks the config describes")
    setup = parallel.ntp_parallel(cfg, store, env.rank) if cfg.ntp.enabled else parallel.uniform_parallel(cfg)
    pg = setup.pg
    torch.manual_seed(t.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(t.seed)

    tf_config = model_lib.transformer_config(cfg)
    healthy = setup.groups is None or setup.groups.healthy
    model = model_lib.build_model(cfg, tf_config, pg, device, setup.topology, env.rank, own_buckets_sync=healthy)
    if setup.topology is not None:
        setup.grad_sync = GradSync(setup.topology, env.rank, setup.groups, model, tf_config,
                                   model_lib.ddp_config(cfg))
        tf_config.finalize_model_grads_func = setup.grad_sync.finalize_model_grads
        set_grad_norm_override(setup.grad_sync.grad_norm)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer=t.optimizer, lr=t.lr, sgd_momentum=t.sgd_momentum, min_lr=t.min_lr, weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
            clip_grad=t.clip_grad, bf16=t.precision == "bf16", fp16=t.precision == "fp16",
            params_dtype=tf_config.params_dtype,
            use_distributed_optimizer=p.use_distributed_optimizer,
        ),
        [model],
        use_gloo_process_groups=False,
        pg_collection=pg,
    )
    if setup.grad_sync is not None and len(getattr(optimizer, "chained_optimizers", [optimizer])) != 1:
        # The norm override returns the global norm; a chain of several would combine it several times.
        raise SystemExit("NTP's grad norm override expects a single optimizer (expert parameters?)")
    samples_per_iter = t.global_batch_size
    scheduler = OptimizerParamScheduler(
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

    run_dir = env.run_dir
    tokenizer = data.build_tokenizer(cfg.data, cfg.model.vocab_size)
    cache_dir = Path(cfg.data.cache_dir) if cfg.data.cache_dir else run_dir / "data_cache"
    dataset = data.build_train_dataset(cfg, tokenizer, cache_dir)

    coords = checkpoint.ParallelCoords(
        tp_rank=setup.tp_rank, tp_size=p.tensor_model_parallel_size,
        dp_rank=setup.replica, dp_size=p.data_parallel_size,
    )
    trainer = Trainer(
        cfg=cfg, model=model, optimizer=optimizer, scheduler=scheduler, dataset=dataset, setup=setup,
        device=device, coords=coords, is_reporting_rank=env.rank == 0, tf_config=tf_config,
        failures=faults.FailureTrigger(env.rank, faults.from_env()),
        comm_stats=CommStats().install() if cfg.logging.comm_stats else None,
    )
    if cfg.checkpoint.load:
        trainer.iteration = checkpoint.load_checkpoint(
            Path(cfg.checkpoint.load), model, optimizer, scheduler, coords
        )
    trainer.run()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
