"""``ntp-pretrain``: the program each rank runs. Started by ``ntp-launch``, never by hand.

Reads the config the launcher resolved, joins the job through the launcher's store, builds the Megatron-Core
stack (parallel groups, GPTModel, DDP, optimizer, scheduler, datasets) and trains.

Importing this module imports torch and Megatron-Core (seconds of CPU per process): the launcher imports
it once and forks every rank from there, so ranks start without paying it again.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Optional

from ntp_megatron.training import runtime

runtime.quiet_optional_dependency_warnings()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import tensor_parallel  # noqa: E402

from ntp_megatron import faults, phases  # noqa: E402

from ntp_megatron.speed import compute_time, device_model  # noqa: E402
from ntp_megatron.config import timing  # noqa: E402
from ntp_megatron.config.schema import JobConfig  # noqa: E402
from ntp_megatron.elastic import errors, keys, sequences  # noqa: E402
from ntp_megatron.elastic.generation import ElasticRank, JobStopped, NodePlane  # noqa: E402
from ntp_megatron.elastic.reform import Retired  # noqa: E402
from ntp_megatron.elastic.session import ElasticSession, NullSession  # noqa: E402
from ntp_megatron.elastic.watchdog import store_factory  # noqa: E402
from ntp_megatron.patches import apply_patches  # noqa: E402
from ntp_megatron.patches.optimizer_param_groups import set_identical_param_groups  # noqa: E402
from ntp_megatron.plan.placement import Placement, launch_nodes, launch_slots  # noqa: E402
from ntp_megatron.speed.power import open_limits  # noqa: E402
from ntp_megatron.training.boosting import Booster  # noqa: E402
from ntp_megatron.training.builder import RankBuilder  # noqa: E402
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
    timing.use(cfg.timing)
    if env.world_size != cfg.world_size:
        raise SystemExit(f"world size {env.world_size} != the {cfg.world_size} ranks the config describes")
    device = runtime.select_device(cfg.training.device)
    apply_patches(cpu=device.type == "cpu")
    trainer, store = build_elastic_trainer(env, cfg, device) if cfg.ntp.enabled else \
        build_plain_trainer(env, cfg, device)
    try:
        return _run(trainer, store, env, cfg)
    finally:
        if trainer.booster is not None:  # every way out (ranks end by os._exit: no atexit handler runs)
            trainer.booster.close()


def _run(trainer: Trainer, store, env: runtime.RankEnv, cfg: JobConfig) -> int:
    """The run, and what this rank's way out of it says (an exit code)."""
    try:
        trainer.run()
    except Retired as retired:
        print(retired.code, flush=True)
        trainer.session.end()
        return 0
    except JobStopped:
        raise
    except SystemExit as exc:
        if not isinstance(exc.code, str):
            raise
        return errors.report(store, env.rank, exc)  # our own clear stop (e.g. a checkpoint of another model)
    except errors.OWN_OR_PEER as exc:  # noqa: BLE001
        # NTP off, any torch.distributed error counts as an echo (a peer's death on NCCL often reads like a
        # backend error of one's own): a misread own error still ends or restarts the job, a misread echo would
        # stop the restart the real failure deserves.
        if not cfg.ntp.enabled and (isinstance(exc, dist.DistError) or errors.is_peer_failure(exc)):
            # One line, not a traceback per rank: the launcher reports the rank whose failure this echoes.
            print(f"stopped: a collective failed because another rank did ({str(exc).splitlines()[0][:160]})",
                  file=sys.stderr, flush=True)
            return runtime.EXIT_PEER_FAILED
        if cfg.ntp.enabled and errors.is_device_lost(exc):  # no report: the replica re-forms without this rank
            print(f"device lost: launch rank {env.rank} counts as dead ({str(exc).splitlines()[0][:160]})",
                  file=sys.stderr, flush=True)
            return runtime.EXIT_DEVICE_LOST
        # Under NTP the session has told this rank's own error from a peer's failure (which it absorbs).
        return errors.report(store, env.rank, exc)
    if not cfg.ntp.enabled:
        dist.destroy_process_group()
    return 0


def build_plain_trainer(env: runtime.RankEnv, cfg: JobConfig, device: torch.device) -> tuple[Trainer, dist.Store]:
    """NTP off: Megatron's own dense grid, built once. A function of its own so that nothing of the setup stays
    referenced from ``main``."""
    p, t = cfg.parallel, cfg.training
    backend = runtime.select_backend(p.backend, device)
    control = runtime.connect_store(env, p.timeout_s)  # node 0's launcher built the dataset before its store
    datasets = _dataset(env, cfg)
    runtime.init_process_group(env, control, backend, p.timeout_s, generation=env.restart)
    setup = parallel.uniform_parallel(cfg)
    setup.generation = env.restart  # each restart is a generation of its own in the records
    torch.manual_seed(t.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(t.seed)
    parts = build_components(cfg, setup, device)
    clock = compute_time.clock_for(device.type)
    emulated = _install_failures(env, control, cfg, clock)
    trainer = Trainer(cfg=cfg, parts=parts, datasets=datasets, device=device, launch_rank=env.rank,
                      session=NullSession(env.rank), comm_stats=_comm_stats(cfg),
                      booster=_booster(cfg, env, device, emulated), clock=clock)
    # A restart resumes from the newest checkpoint of this run, if any, all of it; else from checkpoint.load (which
    # the launcher pinned to one complete checkpoint, and to the parts of it to load).
    ck = cfg.checkpoint
    restarted_from = checkpoint.restart_checkpoint(ck) if env.restart else None
    load = restarted_from or ck.load
    if load:
        plan = checkpoint.FULL if restarted_from else checkpoint.LoadPlan.of(ck)
        progress = checkpoint.load_checkpoint(Path(load), parts.model, parts.optimizer, parts.scheduler,
                                              trainer.coords, plan)
        trainer.iteration, trainer.consumed_samples = progress.iteration, progress.samples(t.global_batch_size)
    return trainer, control


def build_elastic_trainer(env: runtime.RankEnv, cfg: JobConfig, device: torch.device) -> tuple[Trainer, dist.Store]:
    """NTP on: everything but the layout-dependent objects, which the first (re-)formation builds."""
    set_identical_param_groups(True)  # a re-formation builds optimizers on some ranks only
    p = cfg.parallel
    backend = runtime.select_backend(p.backend, device)
    sequences.install(cfg.ntp.collective_sequences, backend)  # before any process group: what the heartbeat counts
    elastic = ElasticRank(env.rank, store_factory(env.store_host, env.store_port),
                          backend, p.timeout_s, cfg.ntp.heartbeat_interval_s,
                          _node_plane(env, cfg), root_port=env.store_port)
    # Once generation 0 is published, node 0's launcher has built the dataset's index caches: read them here,
    # before any process group, so no barrier exists that a failure could hang.
    datasets = _dataset(env, cfg)
    clock = compute_time.clock_for(device.type)
    emulated = _install_failures(env, elastic.ctl, cfg, clock)
    session = ElasticSession(cfg, elastic, RankBuilder(cfg, device), joining=env.joining)
    trainer = Trainer(cfg=cfg, parts=None, datasets=datasets, device=device, launch_rank=env.rank, session=session,
                      comm_stats=_comm_stats(cfg), joining=env.joining, booster=_booster(cfg, env, device, emulated),
                      clock=clock)
    return trainer, elastic.ctl


def _node_plane(env: runtime.RankEnv, cfg: JobConfig):
    """On several nodes, the two-level control plane: this node's store (the root itself on node 0) and where every
    launch rank runs. None on one node."""
    if env.nnodes == 1:
        return None
    p = cfg.parallel
    placement = Placement(p.tensor_model_parallel_size, p.data_parallel_size, env.nnodes,
                          p.pipeline_model_parallel_size, nnodes_per_domain=env.nnodes_per_domain)
    slots = launch_slots(p.tensor_model_parallel_size, p.data_parallel_size, cfg.topology(),
                         p.pipeline_model_parallel_size)
    if env.node == 0:  # node 0's store is the root
        host, port = env.store_host, env.store_port
    elif env.node_store_port is None:  # a second client of the root would count every node in one key
        raise RuntimeError(f"node {env.node} of {env.nnodes}: the launcher set no {runtime.ENV_NODE_STORE_PORT}")
    else:
        host, port = "127.0.0.1", env.node_store_port
    return NodePlane(store_factory(host, port), port, env.node, launch_nodes(placement, slots), cfg.ntp.min_tp,
                     cfg.ntp.on_unrecoverable)


def _comm_stats(cfg: JobConfig) -> Optional[CommStats]:
    return CommStats().install() if cfg.logging.comm_stats else None


_PREBUILT_DATASET = None
"""The datasets (training, validation, test), when the launcher built them before forking this rank (index caches
written once)."""


def prebuild_dataset(run_dir: Path, cfg: JobConfig) -> None:
    """In the launcher, before forking ranks: build the dataset (writing Megatron's index caches once, with no
    process group) for the forked ranks to inherit."""
    global _PREBUILT_DATASET
    _PREBUILT_DATASET = _build_dataset(run_dir, cfg)


def _dataset(env: runtime.RankEnv, cfg: JobConfig):
    if _PREBUILT_DATASET is not None:
        return _PREBUILT_DATASET
    return _build_dataset(env.run_dir, cfg)


def _build_dataset(run_dir: Path, cfg: JobConfig):
    tokenizer = data.build_tokenizer(cfg.data, cfg.model.vocab_size)
    cache_dir = Path(cfg.data.cache_dir) if cfg.data.cache_dir else run_dir / "data_cache"
    return data.build_datasets(cfg, tokenizer, cache_dir)


def _install_failures(env: runtime.RankEnv, store, cfg: JobConfig,
                      clock) -> Optional[device_model.EmulatedDevice]:
    """This rank's injected failures and slowdowns (``--inject-failure``) and its emulated device
    (``ntp.emulated_device_ms``), plugged into the phases the training code names."""
    specs = faults.from_env()
    failures = [s for s in specs if isinstance(s, faults.RankFailure)]
    armable = faults.armable()
    slow = [s for s in specs if isinstance(s, faults.SlowRank) and s.rank == env.rank]
    slowdown = None
    if slow or armable:  # a random draw of slow paces a rank that had no slowdown
        slowdown = faults.DeviceSlowdown(env.rank, slow, compute_time.DeviceSleep(clock.cuda)) if isinstance(
            clock, compute_time.DeviceClock) else faults.Slowdown(env.rank, slow)
    if failures or armable:
        faults.install(faults.FailureTrigger(env.rank, failures, on_fire=_record_failure(store, env.rank),
                                             fired=lambda spec: keys.has_fired(store, spec),
                                             take=(lambda: keys.take_armed(store, env.rank)) if armable else None,
                                             slowdown=slowdown))
    paces = []
    device = None
    if cfg.ntp.emulated_device_ms is not None:
        device = device_model.EmulatedDevice(cfg.ntp.emulated_device_ms)
        device_model.install(device)
        paces.append(device)
    if slowdown is not None:
        paces.append(slowdown)  # after the device: it stretches the device's compute too
    if isinstance(clock, compute_time.DeviceClock):
        paces.append(clock)  # last: the passes end after any sleep enqueued at the same point
    phases.install_pace(*paces)
    return device


def _booster(cfg: JobConfig, env: runtime.RankEnv, device: torch.device,
             emulated: Optional[device_model.EmulatedDevice]):
    """Power boost for this rank (``ntp.boost``), on its device's NVML power limit or as a dry run."""
    if not cfg.ntp.boost:
        return None
    uuid = None
    if device.type == "cuda":  # NVML names the device by its UUID (its indices are not CUDA's)
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    return Booster(cfg.ntp.boost_model(), open_limits(uuid, cfg.ntp.boost_dry_run), env.rank, emulated)


def _record_failure(store, launch_rank: int):
    """What an injected failure leaves behind for the launcher's report: which spec, where, when."""
    def record(spec: faults.RankFailure) -> None:
        keys.record_failure(store, launch_rank, spec)

    return record


if __name__ == "__main__":  # a rank the launcher spawned (a restart), rather than forked
    runtime.become_rank_process(int(os.environ.get(runtime.ENV_RANK, "0")))
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as a forked rank ends: no destructor of a gloo group a blocked thread still uses
