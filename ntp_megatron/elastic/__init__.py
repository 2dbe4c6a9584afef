"""Live failures: detection, generations, the exact-once commit of each iteration, re-formation.

Launcher side: :mod:`.controller` (decides the next topology and settles the iteration in flight) and :mod:`.agent`
(reaps, fences hung ranks, executes controller-side kills). Rank side: :mod:`.session` (the one object the training loop
calls), :mod:`.generation` (this process's membership in the job's generations), :mod:`.watchdog` (heartbeat; gets the
rank out of a collective the moment its generation is over), :mod:`.commit` (one store decision per iteration),
:mod:`.reform` (rebuilds groups, layers and optimizer state for the next generation, through the small interfaces of
:mod:`.interfaces` that the training code implements) and :mod:`.errors` (a rank's own error told apart from a peer's
failure), :mod:`.formation` (what a rank keeps, rebuilds or receives in a re-formation), :mod:`.boundary` (admissions
and rebalances at an iteration boundary), :mod:`.failure_report` and :mod:`.reform_report` (what a failure and a
re-formation are reported as), :mod:`.relay` (a node's copy of the root store's decisions: the two-level control plane),
:mod:`.group_backend` (the process groups of a generation). :mod:`.keys` lists the owner of every key they share in the
launcher's store (:mod:`.commit`, :mod:`.publication`, itself; :mod:`ntp_megatron.launch.nodes` for the launchers'):
only an owner names its keys and calls the store on them.
The controller's decisions are made without the store, over plain inputs, in :mod:`.triage`.

May import: :mod:`ntp_megatron.config`, :mod:`ntp_megatron.plan`, :mod:`ntp_megatron.core`, the patches and the
cross-cutting top-level modules; never :mod:`ntp_megatron.training`, :mod:`ntp_megatron.launch`, :mod:`ntp_megatron.sim`
or :mod:`ntp_megatron.bench`.
"""
