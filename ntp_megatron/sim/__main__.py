from ntp_megatron.sim.cli import main

raise SystemExit(main())
