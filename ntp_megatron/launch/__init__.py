"""The launcher's parts (``ntp_megatron.launch.launcher`` places, starts, watches and summarises with them).

:mod:`.processes` (rank processes: starting them through :mod:`.forkserver`, their output relayed through
:mod:`.console`, pid records, stopping them), :mod:`.nodes` (node 0's store and what the launchers of a job's
nodes tell each other), :mod:`.modes`, :mod:`.policy` and :mod:`.ntp` (what a death means: one policy per run mode),
:mod:`.rejoin` (replacement processes and warm spares), :mod:`.cli` (the command line).
"""
