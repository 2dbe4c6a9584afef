"""The fork-per-request loop of the suite's long-lived helper processes (``tests/zygote.py`` for ntp-launch,
``python -m tests.plain_megatron serve`` for plain Megatron-Core): they pay their imports once, then fork one child
per request. It imports nothing of ntp-megatron, so the plain Megatron-Core reference can use it.

A request is one JSON line with at least ``stdout`` and ``stderr`` (files for the child's output); the answers are
``{"pid": ...}`` at the fork and ``{"returncode": ...}`` at the child's end. The loop ends with its input."""

from __future__ import annotations

import gc
import json
import os
import sys
from typing import Callable, NoReturn


def redirect_output(request: dict) -> None:
    """The forked child's file descriptors 1 and 2, and ``sys.stdout`` / ``sys.stderr``, into the request's files
    (line-buffered, so what it printed before a kill is there)."""
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)


def serve(child: Callable[[dict], NoReturn], while_running: Callable[[dict], None] = lambda request: None) -> None:
    """Per input line: fork, the child runs ``child(request)`` (which must end the process), the parent answers
    the pid, runs ``while_running(request)`` and answers the child's exit code once it has ended."""
    reply = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        gc.freeze()  # the imports: a collection in the child skips them (as ntp_megatron.launch.forkserver does)
        pid = os.fork()
        if pid == 0:
            child(request)
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        while_running(request)
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        reply.flush()
