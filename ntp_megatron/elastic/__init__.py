"""Live failures: detection, generations, the exact-once commit of each iteration, re-formation.

Launcher side: :mod:`.controller` (decides the next topology and settles the iteration in flight) and
:mod:`.agent` (reaps, fences hung ranks, executes controller-side kills). Rank side: :mod:`.watchdog`
(heartbeat; gets the rank out of a collective the moment its generation is over), :mod:`.commit` (one
store decision per iteration) and :mod:`.reform` (rebuilds groups, layers and optimizer state for the next
generation). :mod:`.keys` names what they share in the launcher's store.
"""
