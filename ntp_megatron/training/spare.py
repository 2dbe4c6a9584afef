"""A warm spare: a rank process started before it is needed, waiting to become a failed rank's replacement.

The launcher starts spares with its ranks (``ntp.warm_spares`` per node): forked from its imports on CPU, or,
wherever CUDA may be used, as a fresh interpreter that does the torch and Megatron-Core imports first
(``python -m ntp_megatron.training.spare``). Either then blocks on its assignment pipe. When a replacement for a
launch rank of this node is due, the launcher writes that rank's environment there (JSON) and closes it: the spare
takes it (its launch rank, its device — selected only now — the store, the joining flag) and runs
:func:`ntp_megatron.training.pretrain.main` as that rank's joining process. A pipe closed with nothing in it means
the spare was not needed: it exits 0.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

from ntp_megatron.training import runtime


def wait_for_assignment(fd: int) -> Optional[dict[str, str]]:
    """The environment of the rank this spare becomes, or None if the launcher closed the pipe without one."""
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    data = b"".join(chunks)
    return json.loads(data) if data else None


def serve() -> int:
    """Wait for an assignment, then run as the assigned rank; the process's exit code."""
    env = wait_for_assignment(int(os.environ[runtime.ENV_SPARE_FD]))
    if env is None:
        return 0
    os.environ.clear()
    os.environ.update(env)
    runtime.become_rank_process(int(env[runtime.ENV_RANK]))
    from ntp_megatron.training import pretrain  # loaded already by __main__ below; a name for it here

    return pretrain.main()


if __name__ == "__main__":  # a spare the launcher spawned: the imports first, while nobody waits for it
    runtime.set_process_name("ntp-spare")
    runtime.quiet_optional_dependency_warnings()
    import ntp_megatron.training.pretrain  # noqa: E402,F401 - the seconds a spare exists to have spent already

    code = serve()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as a rank ends: no destructor of a gloo group a blocked thread still uses
