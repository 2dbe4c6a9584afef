"""``ntp-sim``: run a goodput simulation from a YAML config and write tables, JSON and plots."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from ntp_megatron.config.files import EXIT_CONFIG_ERROR, ConfigError
from ntp_megatron.sim.config import load
from ntp_megatron.sim.report import summary_table, write_outputs
from ntp_megatron.sim.run import simulate


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ntp-sim",
        description="Cluster-scale goodput simulator: checkpoint-restart, DP-drop, hot spares, NTP, NTP + power boost.",
    )
    p.add_argument("config", nargs="?", help="YAML config (see configs/sim/); defaults apply without one")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set run.trials=20 (repeatable)")  # fmt: skip
    p.add_argument("--out", type=Path, help="output directory (default: runs/sim/<config name>)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="ntp-sim: %(message)s")

    started = time.perf_counter()
    try:
        base, points = load(args.config, args.overrides)
        results, notes = simulate(points, progress=not args.no_progress and sys.stderr.isatty())
    except ConfigError as exc:
        print(f"ntp-sim: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    name = Path(args.config).stem if args.config else "default"
    out = args.out or Path("runs/sim") / name
    title = base.title or name
    written = write_outputs(base, results, notes, out, title, plots=not args.no_plots)
    lay = results[0].layout.describe()
    print(f"# {title}")
    print(
        ("first point: " if len(results) > 1 else "")
        + f"{lay['job_gpus']} job GPUs: DP {lay['dp']} x PP {lay['pp']} x TP {lay['tp']} in domains of "
        f"{lay['domain_size']}; {lay['spare_domains']} spare domains; mode {base.failures.mode}, "
        f"{base.run.trials} trials, batch policy {base.strategies.batch_policy}, degraded speed "
        + (
            f"integer batch (local batch {base.strategies.degraded_speed.local_batch})"
            if base.strategies.degraded_speed.model == "integer_batch"
            else "continuous"
        )
    )
    print()
    print(summary_table(base, results))
    print()
    for n in notes:
        print(f"note: {n}")
    print(f"wrote {', '.join(str(w) for w in written)}")
    print(f"simulated in {time.perf_counter() - started:.2f} s")
    return 0


if __name__ == "__main__":  # python -m ntp_megatron.sim.cli does what ntp-sim does
    raise SystemExit(main())
