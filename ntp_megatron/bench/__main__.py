"""``python -m ntp_megatron.bench``: the benchmark's command line (``scripts/bench.sh``)."""

from ntp_megatron.bench.cli import main

raise SystemExit(main())
