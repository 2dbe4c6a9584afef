"""The launcher's parts (``ntp_megatron.launch.launcher`` places, starts, watches and summarises with them).

:mod:`.processes` (rank processes: starting them through :mod:`.forkserver`, their output relayed through
:mod:`.console`, pid records, stopping them), :mod:`.nodes` (node 0's store and what the launchers of a job's
nodes tell each other), :mod:`.modes`, :mod:`.policy` and :mod:`.ntp` (what a death means: one policy per run mode),
:mod:`.rejoin` (replacement processes and warm spares), :mod:`.cli` (the command line), :mod:`.preflight` (the
checks before any rank starts), :mod:`.describe` (the launch's plan in words), :mod:`.summary` and
:mod:`.run_report` (the end-of-run summary and the run plot).

May import: :mod:`ntp_megatron.config`, :mod:`ntp_megatron.plan`, :mod:`ntp_megatron.elastic`,
:mod:`ntp_megatron.training` (the ranks it forks run it) and the cross-cutting top-level modules; never
:mod:`ntp_megatron.sim` or :mod:`ntp_megatron.bench`.
"""
