"""A process that has imported torch and Megatron-Core once and forks one launcher per test job.

Starting ``python -m ntp_megatron.launch.launcher`` costs seconds of imports per job; the suite runs dozens of jobs.
The zygote reads one JSON request per line (``args``, ``cwd``, ``stdout``, ``stderr``, optionally ``module``), forks
a child that becomes the launcher (``ntp_megatron.launch.launcher.main(args)``; or ``<module>.main(args)``, e.g. the
plain Megatron-Core helper of the checkpoint tests), output to the given files, its own process group, answers
``{"pid": ...}``, waits for it and answers ``{"returncode": ...}``. The zygote starts no thread, so
forking it is as safe as the launcher forking its ranks.

What a launcher imports only once its job has ended (matplotlib, for the run plot: seconds per job under load) the
zygote imports once, while its first launcher job runs (:func:`_import_late`; not while a module runs: the short
refusals of the unit tests do not wait for it): its own start stays as short as it was, and every later job skips
those imports too.
"""

from __future__ import annotations

import importlib
import os
import sys

from ntp_megatron.training import runtime

runtime.quiet_optional_dependency_warnings()
import ntp_megatron.training.pretrain  # noqa: E402,F401 - the imports every job then skips
from ntp_megatron.launch import launcher  # noqa: E402
from ntp_megatron.launch.forkserver import run_forked_child  # noqa: E402
from tests import forked  # noqa: E402


def _child(request: dict) -> None:
    def start() -> object:
        os.setsid()
        os.chdir(request["cwd"])
        forked.redirect_output(request)
        module = request.get("module")
        sys.argv = [module or "ntp-launch", *request["args"]]
        main = launcher.main
        if module:
            # As under ``python -m module``: processes it spawns (multiprocessing) re-import it, not this zygote.
            sys.modules["__main__"] = importlib.import_module(module)
            main = sys.modules["__main__"].main
        return main(request["args"])

    run_forked_child(start)


def _import_late() -> None:
    """The launcher's end-of-job imports (``ntp_megatron.launch.run_report.plot``: matplotlib with its Agg backend, which
    writes PNGs through Pillow). None of them starts a thread."""
    import matplotlib

    matplotlib.use("Agg")  # what run_report.plot selects
    import matplotlib.backends.backend_agg  # noqa: F401
    import matplotlib.pyplot  # noqa: F401
    import PIL.Image  # noqa: F401
    import PIL.PngImagePlugin  # noqa: F401


def main() -> None:
    late_imported = False

    def while_running(request: dict) -> None:
        nonlocal late_imported
        if not late_imported and "module" not in request:  # while the first job runs: the next ones are forked
            _import_late()                                     # with these imports done
            late_imported = True

    forked.serve(_child, while_running)


if __name__ == "__main__":
    main()
