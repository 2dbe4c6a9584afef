"""Initialisation cost of one rank's model (``scripts/bench.sh --only init``): Megatron replay (every full-size master
weight drawn on every rank, then the rank's units kept) against the layout-free initialiser (only the rank's units
computed), at each TP of ``Sizes.init_tps``, on a wider model (``Sizes.init_model``). Each measurement is a probe
in a fresh process (``python -m ntp_megatron.bench.init_weights TP INIT``, rank 0's canonical block), so that its
peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ntp_megatron.bench.common import RunModule, ratio
from ntp_megatron.bench.sizes import FULL, Sizes
from ntp_megatron.config.schema import load_job_config

INIT_KINDS = ("megatron", "layout_free")


def init_probe(tp: int, init: str, model: Sequence[str] = FULL.init_model) -> dict:
    """In a fresh process: build rank 0's NTP model of a TP ``tp`` replica with ``init``; time and peak RSS."""
    # Megatron-Core (a few seconds to import) loads in the probe's own process, never in the benchmark's driver
    from megatron.core import parallel_state

    from ntp_megatron.core.groups import dense_groups
    from ntp_megatron.core.gpt import RankUnits, build_ntp_gpt
    from ntp_megatron.patches import apply_patches
    from ntp_megatron.patches import parallel_state as ps_patch
    from ntp_megatron.training.model import transformer_config

    torch.set_num_threads(1)  # as a rank runs (the launcher's default OMP_NUM_THREADS=1)
    apply_patches(cpu=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank: no port
    pg_collection = ps_patch.install(dense_groups(1, 0, 1, timedelta(seconds=60)))  # Megatron's groups of one rank
    cfg = load_job_config(None, [*model, f"parallel.tensor_model_parallel_size={tp}",
                                 "parallel.data_parallel_size=1", f"model.init={init}"])
    m = cfg.model
    units = RankUnits(*(tuple(cfg.topology().units_of(0, f)) for f in ("heads", "ffn", "vocab")))
    tf_config = transformer_config(cfg, torch.device("cpu"))
    torch.manual_seed(cfg.training.seed)
    page_mb = os.sysconf("SC_PAGE_SIZE") / 2 ** 20
    rss_start_mb = int(open("/proc/self/statm").read().split()[1]) * page_mb
    started = time.perf_counter()
    model = build_ntp_gpt(tf_config, units, m.normalization, m.vocab_size, init=init, seed=cfg.training.seed,
                          max_sequence_length=m.seq_length, pre_process=True, post_process=True,
                          share_embeddings_and_output_weights=True, position_embedding_type=m.position_embedding_type,
                          pg_collection=pg_collection)
    seconds = time.perf_counter() - started
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    params = sum(p.numel() for p in model.parameters())
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return {"tp": tp, "init": init, "build_s": seconds, "peak_rss_mb": peak_mb,
            "peak_over_start_mb": peak_mb - rss_start_mb, "local_params": params,
            "local_param_mb": params * 4 / 2 ** 20}


def measure_init(sizes: Sizes, run: RunModule, workdir: Path) -> dict:
    """Every (TP, initialiser) pair in its own process, interleaved over ``sizes.rounds``; medians."""
    runs: dict[str, list[dict]] = {f"{init} tp{tp}": [] for tp in sizes.init_tps for init in INIT_KINDS}
    for round_index in range(sizes.rounds):
        for tp in sizes.init_tps:
            for init in INIT_KINDS:
                out = Path(tempfile.mkdtemp(prefix=f"init-{init}-tp{tp}", dir=workdir))
                probe = [str(tp), init, *(f"--model={kv}" for kv in sizes.init_model)]
                code, stdout, err = run("ntp_megatron.bench.init_weights", probe, out)
                if code != 0:
                    raise SystemExit(f"bench: init probe tp{tp} {init} failed:\n{err[-3000:]}")
                runs[f"{init} tp{tp}"].append(json.loads(stdout.strip().splitlines()[-1]))
                print(f"init round {round_index + 1}/{sizes.rounds} {init:<12} tp{tp} done", file=sys.stderr)
    keys = ("build_s", "peak_rss_mb", "peak_over_start_mb", "local_param_mb")
    cases = {name: {key: statistics.median(r[key] for r in rs) for key in keys} for name, rs in runs.items()}
    for name, c in cases.items():
        c["best_build_s"] = min(r["build_s"] for r in runs[name])  # the least disturbed by other load
        base = cases[name.rsplit(" ", 1)[0] + " tp1"]
        c["best_build_s_over_tp1"] = ratio(c["best_build_s"], base["best_build_s"])
        c["peak_over_start_over_tp1"] = ratio(c["peak_over_start_mb"], base["peak_over_start_mb"])
    return {"model": " ".join(sizes.init_model), "rounds": sizes.rounds, "runs": runs, "cases": cases}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The probe's entry: one measurement, its JSON on the last line of stdout."""
    p = argparse.ArgumentParser(prog="ntp_megatron.bench.init_weights", description=main.__doc__)
    p.add_argument("tp", type=int)
    p.add_argument("init", choices=INIT_KINDS)
    p.add_argument("--model", action="append", default=[], help="a model key=value (default: the full run's model)")
    args = p.parse_args(argv)
    print(json.dumps(init_probe(args.tp, args.init, args.model or FULL.init_model)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
