"""What a Megatron user brings that is not a training checkpoint, written and read by plain Megatron-Core (no
ntp-megatron code, not even its patches of upstream): model weights only, and the losses plain Megatron-Core computes when it trains on from
them with a fresh optimizer and scheduler.

    python -m tests.megatron_model_only --tp 2 --pretrain 1 --save DIR --layout release --iters 2 --out ref.json
    python -m tests.megatron_model_only --tp 1 --load CKPT --start 3 --iters 6 --out ref.json

The weights come from ``--pretrain K`` iterations of :mod:`tests.plain_megatron`'s GPTModel from Megatron's own
initialisation (so they are not what a run initialises itself from the seed), or from the model part of the
checkpoint ``--load`` (any Megatron-Core checkpoint, ours included: only ``{"model": ...}`` is requested).
``--save DIR`` writes them as ``dist_checkpointing.save({"model": model.sharded_state_dict()}, ...)`` and
nothing else (no iteration, no optimizer, scheduler or RNG state), in one of Megatron-LM's directory layouts:

- ``release``: ``DIR/release/`` and ``DIR/latest_checkpointed_iteration.txt`` holding ``release`` (what
  Megatron-LM's checkpoint converters write);
- ``iter``: ``DIR/iter_<K>/`` and ``latest_checkpointed_iteration.txt`` holding ``K``.

Then the reference: a fresh GPTModel, optimizer and scheduler (``build(Layout(tp), --iters, pg)``) read the weights back from
the saved directory (or ``--load``), model part only, and train iterations ``--start + 1 .. --iters`` on the
batches of those iterations; ``--out`` gets each one's lm loss, grad norm and learning rate. That is Megatron-LM's
``--finetune`` (``--start 0``) and ``--no-load-optim`` (``--start`` the checkpoint's iteration): model weights
loaded, optimizer and scheduler fresh.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch.distributed as dist

from tests.plain_megatron import Layout, build, dataset, fork_ranks, process_groups, run_rank, run_without_cuda, \
    train_step

LATEST_FILE = "latest_checkpointed_iteration.txt"


def model_only(model) -> dict:
    return {"model": model.module.sharded_state_dict()}


def save_model_only(model, root: Path, layout: str, iteration: int) -> Path:
    """The model part only, in ``root/release`` or ``root/iter_<iteration>``, with the tracker file naming it."""
    from megatron.core import dist_checkpointing

    name, tracker = ("release", "release") if layout == "release" else (f"iter_{iteration:07d}", str(iteration))
    path = root / name
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model_only(model), str(path))
    if dist.get_rank() == 0:
        (root / LATEST_FILE).write_text(tracker + "\n")
    dist.barrier()
    return path


def run(rank: int, tp: int, args) -> None:
    from megatron.core import dist_checkpointing

    cache = Path(args.out).parent / "model_only_data_cache"
    load = Path(args.load) if args.load else None
    layout = Layout(tp=tp)
    pg = process_groups(layout)
    if args.pretrain:
        model, optimizer, scheduler = build(layout, args.pretrain + 1, pg)  # a schedule longer than its warmup
        data = dataset(args.pretrain, cache)
        for iteration in range(args.pretrain):
            train_step(model, optimizer, scheduler, data, iteration, layout, pg)
        load = save_model_only(model, Path(args.save), args.layout, args.pretrain)
        del model, optimizer, scheduler
    model, optimizer, scheduler = build(layout, args.iters, pg)  # fresh optimizer and scheduler
    state = dist_checkpointing.load(model_only(model), str(load))
    model.module.load_state_dict(state["model"])
    data = dataset(args.iters, cache)
    records = {iteration + 1: train_step(model, optimizer, scheduler, data, iteration, layout, pg)
               for iteration in range(args.start, args.iters)}
    if rank == 0:
        Path(args.out).write_text(json.dumps(records))


def _worker(rank: int, port: int, world: int, args) -> None:
    run_rank(rank, Layout(tp=world), port, lambda: run(rank, world, args))


def launch(world: int, args) -> None:
    """Fork ``world`` ranks of a TP-``world`` job, every wait bounded."""
    procs, store = fork_ranks(world, _worker, world, args)  # noqa: F841 - the store serves them
    for p in procs:
        p.join(timeout=300)
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    for p in procs:
        if p.exitcode is None:
            p.kill()
    if failed:
        raise SystemExit(f"megatron_model_only at TP{world}: ranks {failed} failed")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--pretrain", type=int, default=0, help="train this many iterations, then --save")
    parser.add_argument("--save", default="", help="with --pretrain: the root to write the model-only checkpoint in")
    parser.add_argument("--layout", choices=["release", "iter"], default="release")
    parser.add_argument("--load", default="", help="without --pretrain: a checkpoint whose model part to read")
    parser.add_argument("--start", type=int, default=0, help="the iteration the reference resumes at")
    parser.add_argument("--iters", type=int, required=True, help="the run's train_iters")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if bool(args.pretrain) == bool(args.load) or bool(args.pretrain) != bool(args.save):
        parser.error("either --pretrain K --save DIR, or --load CKPT")
    import warnings

    warnings.filterwarnings("ignore")
    run_without_cuda()
    # What the ranks import, imported once here: each forked rank would otherwise pay seconds of imports.
    import megatron.core.datasets.blended_megatron_dataset_builder  # noqa: F401
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import megatron.core.tokenizers  # noqa: F401

    launch(args.tp, args)
    # Forked from the test zygote, ntp-megatron is imported (never called here); none of its patches may be in force.
    patches = sys.modules.get("ntp_megatron.patches")
    assert not getattr(patches, "_applied", None), f"ntp-megatron patches in force: {patches._applied}"
    return 0


if __name__ == "__main__":
    sys.exit(main())
