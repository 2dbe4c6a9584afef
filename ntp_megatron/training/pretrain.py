"""``ntp-pretrain``: the program each rank runs. Started by ``ntp-launch``, never by hand.

Reads the config the launcher resolved, joins the job through the launcher's store, builds the Megatron-Core
stack (parallel groups, GPTModel, DDP, optimizer, scheduler, datasets) and trains.

Importing this module imports torch and Megatron-Core (seconds of CPU per process): the launcher imports
it once and forks every rank from there, so ranks start without paying it again.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from ntp_megatron.training import runtime

runtime.quiet_optional_dependency_warnings()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import tensor_parallel  # noqa: E402

from ntp_megatron import faults  # noqa: E402
from ntp_megatron.config import JobConfig  # noqa: E402
from ntp_megatron.elastic import keys  # noqa: E402
from ntp_megatron.patches import apply_patches  # noqa: E402
from ntp_megatron.training import checkpoint, data, parallel  # noqa: E402
from ntp_megatron.training.comm_stats import CommStats  # noqa: E402
from ntp_megatron.training.components import build_components  # noqa: E402
from ntp_megatron.training.loop import Trainer  # noqa: E402


def _setup_logging(rank: int) -> None:
    """Warnings from every rank; our own INFO lines from rank 0 only (``NTP_LOG_LEVEL`` overrides both)."""
    level = os.environ.get("NTP_LOG_LEVEL")
    logging.basicConfig(level=level or "WARNING", format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("ntp_megatron").setLevel(level or ("INFO" if rank == 0 else "WARNING"))


def main() -> int:
    env = runtime.RankEnv.from_environ()
    _setup_logging(env.rank)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher asks for stacks of a stuck rank
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    cfg = JobConfig.model_validate_json(env.config_path.read_text())
    if env.world_size != cfg.world_size:
        raise SystemExit(f"world size {env.world_size} != the {cfg.world_size} ranks the config describes")
    trainer = build_trainer(env, cfg)
    if trainer.elastic is None:
        trainer.run()
        dist.destroy_process_group()
        return 0
    from ntp_megatron.training.reform import Retired

    try:
        trainer.run()
    except Retired as retired:
        print(retired.code, flush=True)
        return 0
    trainer.elastic.leave(trainer.generation)
    trainer.elastic.heartbeat.stop()
    return 0


def build_trainer(env: runtime.RankEnv, cfg: JobConfig) -> Trainer:
    """Everything one rank trains with. A function of its own so that nothing of generation 0 (groups, the
    first model) stays referenced from ``main`` once a re-formation replaced it."""
    device = runtime.select_device(cfg.training.device)
    apply_patches(cpu=device.type == "cpu")
    backend = runtime.select_backend(cfg.parallel.backend, device)
    p, t = cfg.parallel, cfg.training
    elastic = generation = topology = None
    if cfg.ntp.enabled:
        from ntp_megatron.elastic.generation import ElasticRank
        from ntp_megatron.elastic.watchdog import store_factory
        from ntp_megatron.patches.optimizer_param_groups import set_identical_param_groups

        set_identical_param_groups(True)  # a re-formation builds optimizers on some ranks only
        elastic = ElasticRank(env.rank, store_factory(env.store_host, env.store_port), backend, p.timeout_s,
                              cfg.ntp.heartbeat_interval_s)
        topology = elastic.topology(0)
        generation = elastic.join(topology)
        with elastic.scope(generation):
            setup = parallel.ntp_parallel(cfg, topology, generation.rank)
        control = elastic.ctl
    else:
        control = runtime.connect_store(env, p.timeout_s)
        runtime.init_process_group(env, control, backend, p.timeout_s, generation=env.restart)
        setup = parallel.uniform_parallel(cfg)
    torch.manual_seed(t.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(t.seed)
    parts = build_components(cfg, setup, device)

    tokenizer = data.build_tokenizer(cfg.data, cfg.model.vocab_size)
    cache_dir = Path(cfg.data.cache_dir) if cfg.data.cache_dir else env.run_dir / "data_cache"
    dataset = data.build_train_dataset(cfg, tokenizer, cache_dir)

    trigger = faults.FailureTrigger(env.rank, faults.from_env(), on_fire=_record_failure(control, env.rank),
                                    fired=lambda spec: control.check([keys.fired(str(spec))]))
    faults.install(trigger)
    coords = checkpoint.ParallelCoords(
        tp_rank=setup.tp_rank, tp_size=p.tensor_model_parallel_size,
        dp_rank=setup.replica, dp_size=p.data_parallel_size,
    )
    trainer = Trainer(
        cfg=cfg, parts=parts, dataset=dataset, device=device, coords=coords, launch_rank=env.rank,
        failures=trigger, comm_stats=CommStats().install() if cfg.logging.comm_stats else None,
        elastic=elastic, generation=generation,
    )
    load = cfg.checkpoint.load or (cfg.checkpoint.save if env.restart else None)
    if load and checkpoint.resolve_load_dir(Path(load)) is not None:
        trainer.iteration = checkpoint.load_checkpoint(Path(load), parts.model, parts.optimizer, parts.scheduler,
                                                       coords)
    elif cfg.checkpoint.load:
        raise SystemExit(f"checkpoint.load: no checkpoint in {cfg.checkpoint.load}")
    if elastic is not None:
        from ntp_megatron.training.reform import Reformer

        trainer.reformer = Reformer(cfg, elastic, topology,
                                    build=lambda new_setup: build_components(cfg, new_setup, device, initialize=False))
    return trainer


def _record_failure(store, launch_rank: int):
    """What an injected failure leaves behind for the launcher's report: which spec, where, when."""
    def record(spec: faults.RankFailure) -> None:
        store.set(keys.failure(launch_rank), json.dumps({"spec": str(spec), "phase": spec.phase,
                                                         "iteration": spec.iteration, "time": time.time()}))
        store.set(keys.fired(str(spec)), "1")

    return record


if __name__ == "__main__":  # a rank the launcher spawned (a restart), rather than forked
    runtime.become_rank_process(int(os.environ.get(runtime.ENV_RANK, "0")))
    sys.exit(main())
