"""Run real jobs through the real launcher (multi-process gloo) and read what they recorded.

Every job :func:`run_job` runs is also checked for what every re-formation moved: the ``moved_bytes`` of each
``reformed`` event must equal a lower bound computed here, from the job's model dimensions and the two topologies
the controller published (:func:`check_reformations`; ``tests/conftest.py`` applies the same check to metrics
files written by jobs started another way). :func:`assert_replicas_agree` is the one check that every live
(replica, TP rank) reported the same state checksums at every iteration.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional, Sequence

import psutil

REPO = Path(__file__).resolve().parent.parent
JOB_TIMEOUT_S = 300

# The tiny model of the equivalence tests: fp32, dropout off, short sequences.
TINY = [
    "--set", "ntp.enabled=false",  # the default config runs NTP; tests switch it on where they test it
    "--set", "model.hidden_dropout=0.0", "--set", "model.attention_dropout=0.0",
    "--set", "training.micro_batch_size=2", "--set", "training.global_batch_size=12",
    "--set", "training.lr_warmup_iters=1",
    "--set", "logging.log_interval=1", "--set", "logging.tensorboard_dir=",
]


@dataclass
class JobResult:
    returncode: int
    stdout: str
    stderr: str
    records: list[dict]
    run_dir: Path
    reformations: list[dict] = field(default_factory=list)
    """What :func:`check_reformations` found: per ``reformed`` event its generation, moved bytes and bound."""

    def losses(self) -> dict[int, float]:
        return {r["iteration"]: r["lm_loss"] for r in self.records if r.get("kind") == "iteration"}

    def events(self, name: str) -> list[dict]:
        return [r for r in self.records if r.get("kind") == "event" and r.get("event") == name]


# -- starting processes, every wait bounded ------------------------------------------------------------------------

class _Lines:
    """Lines from a pipe, each read with a deadline (``readline`` alone waits forever on a silent writer)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""

    def read(self, deadline: float) -> str:
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            ready, _, _ = select.select([self.fd], [], [], max(remaining, 0.0))
            if not ready:
                raise TimeoutError("no answer before the deadline")
            chunk = os.read(self.fd, 65536)
            if not chunk:
                raise EOFError("the writer closed the pipe")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class _Zygote:
    """Client of ``tests/zygote.py``: one long-lived process that imported torch and Megatron-Core once and
    forks a launcher per job (``NTP_TEST_ZYGOTE=0`` runs ``python -m ntp_megatron.launch.launcher`` instead).

    Every answer is read with a deadline. When a job does not end in time, or the test is interrupted while it
    runs (pytest-timeout raises inside the test), the job's process group is killed and its exit is collected,
    so the zygote is free for the next test; a zygote that does not answer then is killed and started again."""

    COMMAND: tuple[str, ...] = ("-m", "tests.zygote")
    """The server's arguments to the interpreter (a subclass serves other requests the same way)."""
    _proc: Optional[subprocess.Popen] = None
    _lines: Optional[_Lines] = None
    START_S = 120.0
    """Bound on the zygote's own start (its imports) and on collecting a killed job's exit."""

    @classmethod
    def run(cls, args: list[str], stdout: Path, stderr: Path, timeout: float, module: Optional[str] = None,
            cwd: Path = REPO) -> int:
        if cls._proc is None or cls._proc.poll() is not None:
            cls._proc = subprocess.Popen([sys.executable, *cls.COMMAND], cwd=REPO, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE)
            cls._lines = _Lines(cls._proc.stdout.fileno())
        proc, lines = cls._proc, cls._lines
        request = {"args": args, "cwd": str(cwd), "stdout": str(stdout), "stderr": str(stderr)}
        if module is not None:
            request["module"] = module
        pid = None
        try:
            proc.stdin.write((json.dumps(request) + "\n").encode())
            proc.stdin.flush()
            pid = json.loads(lines.read(time.monotonic() + cls.START_S))["pid"]
            try:
                return json.loads(lines.read(time.monotonic() + timeout))["returncode"]
            except TimeoutError:
                raise subprocess.TimeoutExpired(args, timeout) from None
        except BaseException:
            cls._abandon(pid)
            raise

    @classmethod
    def _abandon(cls, pid: Optional[int]) -> None:
        """Kill the job (its whole process group) and collect its exit; restart the zygote if that fails."""
        proc = cls._proc
        if pid is not None:
            _kill_group(pid)
            try:
                os.kill(pid, signal.SIGKILL)  # also before its setsid(): then the group does not exist yet
            except ProcessLookupError:
                pass
            try:
                cls._lines.read(time.monotonic() + cls.START_S)
                return
            except (TimeoutError, EOFError, OSError):
                pass
        proc.kill()
        proc.wait(timeout=cls.START_S)
        cls._proc = None


class Forked:
    """A process forked from a zygote of its own, running while the test acts on it (signals it, reads its files,
    starts another node against it): ``ntp-launch args``, or ``python -m module args``, with
    ``subprocess.Popen``'s ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal`` and ``kill``. Like a process
    started with ``start_new_session=True``, it leads a process group of its own.

    Its zygote (``tests/zygote.py``, one per process running at a time) answers only when the process has ended, so
    it runs no other process meanwhile; once the exit has been read, the next :meth:`start` reuses it. The
    imports are paid once per zygote, not once per process."""

    _idle: list[tuple[subprocess.Popen, _Lines]] = []
    _busy: list["Forked"] = []

    def __init__(self, zygote: subprocess.Popen, lines: _Lines, pid: int) -> None:
        self._zygote, self._lines, self.pid = zygote, lines, pid
        self.returncode: Optional[int] = None

    @classmethod
    def start(cls, args: Sequence[str], stdout: Path, stderr: Path, module: Optional[str] = None,
              cwd: Path = REPO) -> "Forked":
        for forked in list(cls._busy):  # a test that killed its process and did not wait: collect it now
            forked.poll()
        for path in (stdout, stderr):  # there to read at once (the child truncates and writes them)
            path.touch()
        if cls._idle:
            zygote, lines = cls._idle.pop()
        else:
            zygote = subprocess.Popen([sys.executable, "-m", "tests.zygote"], cwd=REPO, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE)
            lines = _Lines(zygote.stdout.fileno())
        request = {"args": list(args), "cwd": str(cwd), "stdout": str(stdout), "stderr": str(stderr)}
        if module is not None:
            request["module"] = module
        try:
            zygote.stdin.write((json.dumps(request) + "\n").encode())
            zygote.stdin.flush()
            pid = json.loads(lines.read(time.monotonic() + _Zygote.START_S))["pid"]
        except BaseException:
            zygote.kill()
            zygote.wait(timeout=_Zygote.START_S)
            raise
        forked = cls(zygote, lines, pid)
        cls._busy.append(forked)
        return forked

    @classmethod
    def ready(cls, count: int, out_dir: Path) -> None:
        """At least ``count`` zygotes started and idle: processes started together then wait for no one's imports
        (a node that must join another within a timeout)."""
        # All started before any ends: each takes an idle zygote or starts one, and all come back idle.
        starting = [cls.start(["--help"], out_dir / f"zygote{i}.stdout", out_dir / f"zygote{i}.stderr",
                              module="ntp_megatron.launch.launcher") for i in range(count)]
        assert [forked.wait() for forked in starting] == [0] * count

    def _read_exit(self, timeout: float) -> Optional[int]:
        if self.returncode is None:
            try:
                self.returncode = json.loads(self._lines.read(time.monotonic() + timeout))["returncode"]
            except TimeoutError:
                return None
            except (EOFError, OSError):  # the zygote itself died: the process went with it
                self.returncode = -signal.SIGKILL
                self._busy.remove(self)
                return self.returncode
            self._busy.remove(self)
            self._idle.append((self._zygote, self._lines))
        return self.returncode

    def poll(self) -> Optional[int]:
        return self._read_exit(0.0)

    def wait(self, timeout: Optional[float] = None) -> int:
        code = self._read_exit(_Zygote.START_S if timeout is None else timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _run_process(cmd: list[str], cwd: Path, timeout: float) -> tuple[int, str, str]:
    """``cmd`` in a process group of its own, killed whole on a timeout or an interruption."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        _kill_group(proc.pid)
        proc.communicate(timeout=_Zygote.START_S)
        raise
    return proc.returncode, out, err


def alive(pids: Sequence[int]) -> list[int]:
    """The processes of ``pids`` that still run (a zombie has ended: only its exit status is left to reap)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def run_job(run_dir: Path, args: Sequence[str] = (), timeout: float = JOB_TIMEOUT_S) -> JobResult:
    """``ntp-launch`` with ``args`` in a fresh run dir; the metrics file is read back as records, and every
    re-formation's moved bytes are checked against the lower bound (:func:`check_reformations`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_file = run_dir / "metrics.jsonl"
    launcher_args = ["--run-dir", str(run_dir), "--metrics-file", str(metrics_file), *args]
    if os.environ.get("NTP_TEST_ZYGOTE", "1") == "1":
        stdout, stderr = run_dir / "launcher.stdout", run_dir / "launcher.stderr"
        returncode = _Zygote.run(launcher_args, stdout, stderr, timeout)
        out, err = stdout.read_text(errors="replace"), stderr.read_text(errors="replace")
    else:
        returncode, out, err = _run_process([sys.executable, "-m", "ntp_megatron.launch.launcher", *launcher_args], REPO,
                                            timeout)
    records = read_records(metrics_file)
    result = JobResult(returncode, out, err, records, run_dir)
    CHECKED_METRICS.add(metrics_file.resolve())
    try:
        result.reformations = check_reformations(records, run_dir)
    except ReformationBoundError as exc:
        exc.result = result
        raise
    return result


def run_module(module: str, args: Sequence[str], out_dir: Path, timeout: float = JOB_TIMEOUT_S,
               cwd: Path = REPO) -> tuple[int, str]:
    """``python -m module args`` in ``cwd`` (forked from the zygote: no imports to pay); returns (exit code,
    stderr)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stdout, stderr = out_dir / f"{module}.stdout", out_dir / f"{module}.stderr"
    if os.environ.get("NTP_TEST_ZYGOTE", "1") == "1":
        returncode = _Zygote.run(list(args), stdout, stderr, timeout, module=module, cwd=cwd)
        return returncode, stderr.read_text(errors="replace")
    returncode, out, err = _run_process([sys.executable, "-m", module, *args], cwd, timeout)
    stdout.write_text(out)
    return returncode, err


def read_records(metrics_file: Path) -> list[dict]:
    if not metrics_file.exists():
        return []
    return [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip().endswith("}")]


def layout_args(tp: int, dp: int, iters: int) -> list[str]:
    return ["--set", f"parallel.tensor_model_parallel_size={tp}", "--set", f"parallel.data_parallel_size={dp}",
            "--set", f"training.train_iters={iters}", *TINY]


def assert_ok(result: JobResult) -> None:
    assert result.returncode == 0, f"job failed ({result.returncode}):\n{result.stderr[-4000:]}"


def relative_difference(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.01) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(poll_s)


def store_server(timeout_s: float = 60.0):
    """A TCPStore hosted by the calling (test) process on a port the OS picks; processes it starts connect to
    ``store.port`` with :func:`store_client`. No port is bound, released and hoped to be free again."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def store_client(port: int, timeout_s: float = 60.0):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, world_size=None, is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


# -- run segments: a restart starts the controller (and the generation numbers) again --------------------------------

@dataclass
class Segment:
    """The records of one controller's run: from its ``generation_published`` event of generation 0 to the next
    one (a restart), or the whole file without NTP."""

    records: list[dict]

    def published(self) -> dict[int, dict]:
        return {r["generation"]: r for r in self.records if r.get("event") == "generation_published"}

    def iterations(self) -> dict[int, dict]:
        return {r["iteration"]: r for r in self.records if r.get("kind") == "iteration"}


def segments(records: list[dict]) -> list[Segment]:
    out: list[list[dict]] = [[]]
    for r in records:
        if r.get("event") == "generation_published" and r["generation"] == 0 and any(
                x.get("event") == "generation_published" for x in out[-1]):
            out.append([])
        out[-1].append(r)
    return [Segment(part) for part in out]


# -- every live (replica, TP rank) reports, and all agree ------------------------------------------------------------

def _live_tp_ranks(topology: dict) -> set[tuple[int, int]]:
    """(replica, TP rank) of every live rank of one stage's published topology."""
    return {(rep["index"], tp_rank) for rep in topology["replicas"] for tp_rank in range(len(rep["slots"]))}


def _stage_topology(topology: dict, stage: int) -> dict:
    """One pipeline stage's part of a published topology (the topology itself without stages)."""
    return topology["stages"][stage] if "stages" in topology else topology


def _widths(topology: dict, dp: int) -> list:
    """The iteration records' ``tp_per_replica`` of a published topology, read from its JSON: every replica index
    of the launch, its live slots (0 if it was dropped); with stages a list per replica, one entry per stage."""
    def stage_widths(stage: dict) -> list[int]:
        live = {rep["index"]: len(rep["slots"]) for rep in stage["replicas"]}
        return [live.get(r, 0) for r in range(dp)]

    if "stages" not in topology:
        return stage_widths(topology)
    per_stage = [stage_widths(stage) for stage in topology["stages"]]
    return [[widths[r] for widths in per_stage] for r in range(dp)]


def _stage_width(width, stage: int) -> int:
    """A replica's width in one stage, from a ``tp_per_replica`` entry (a list of widths with stages)."""
    return width[stage] if isinstance(width, list) else width


def interrupted_iterations(segment: Segment, last_segment: bool) -> dict[int, str]:
    """Iterations whose checksum rows may be incomplete, each with why: only the last iteration of a run segment that
    a failure ended (the job restarted from a checkpoint, or stopped), when a rank died in that iteration's
    generation. The rows of an iteration are gathered after its step; a death then ends every collective of the
    generation, and under NTP the next generation makes the check up (its rows are required below), but nothing
    trains on after a stop or a restart. Every other iteration's rows are checked in full."""
    iterations = segment.iterations()
    if not iterations:
        return {}
    last = max(iterations)
    generation = iterations[last].get("generation", 0)
    deaths = [e for e in segment.records if e.get("event") == "rank_failed"
              and e.get("generation", generation) == generation]
    ended = not last_segment or any(e.get("event") == "job_stopped" for e in segment.records)
    if deaths and ended:
        return {last: f"the last iteration before the {'restart' if not last_segment else 'stop'}, in generation "
                      f"{generation}, in which launch rank {deaths[0]['launch_rank']} died"}
    return {}


def _required_reporters(segment: Segment, iteration: int, stage: int = 0) -> tuple[int, set[tuple[int, int]]]:
    """(generation, the (replica, TP rank) pairs that must have reported the state after ``iteration`` in it): the
    generation that trained on from that state (the next iteration's; the iteration's own for the last one), its
    live ranks except the processes it admitted (they joined with the state and never stepped the iteration)."""
    iterations, generations = segment.iterations(), segment.published()
    own = iterations[iteration].get("generation", 0)
    after = iterations[iteration + 1].get("generation", 0) if iteration + 1 in iterations else own
    if not generations:  # NTP off: every replica at its TP degree
        widths = iterations[iteration]["tp_per_replica"]
        return own, {(rep, t) for rep, w in enumerate(widths) for t in range(_stage_width(w, stage))}
    topology = _stage_topology(generations[after]["topology"], stage)
    joined = {tuple(s) for s in generations[after]["joined"]} if after != own else set()
    return after, {(rep["index"], t) for rep in topology["replicas"] for t, slot in enumerate(rep["slots"])
                   if (rep["index"], slot) not in joined}


def assert_replicas_agree(result: JobResult, iters: Optional[int] = None) -> None:
    """At every recorded iteration, every live (replica, TP rank) reported state checksums, and all are the same:
    every tensor's checksum and the grad-norm bits, in whichever generation they were taken. Which ranks must have
    reported follows from what the job published (:func:`_required_reporters`), not from the reports; a rank of a
    generation reports the iterations it stepped itself, and a re-formation makes up the check a failure cut short,
    so the rows of an iteration can come from two generations (they must agree). ``iters``: iterations 1..iters must
    all have been recorded and checked.

    The only rows allowed missing are those of :func:`interrupted_iterations`; the assertion message names them."""
    checked: set[int] = set()
    all_segments = segments(result.records)
    stages = next((r.get("pipeline_stages", 1) for r in result.records if r.get("event") == "job_started"), 1)
    for n, segment in enumerate(all_segments):
        for stage in range(stages):  # each pipeline stage holds its own tensors: its rows are compared
            checked |= _check_stage_rows(Segment([r for r in segment.records if r.get("stage", 0) == stage]),
                                         last_segment=n == len(all_segments) - 1, stage=stage)
    assert checked, "no state checksums were reported (logging.state_checksums off?)"
    if iters is not None:
        unchecked = sorted(set(range(1, iters + 1)) - checked)
        assert not unchecked, f"iterations without checksums: {unchecked}"


def _check_stage_rows(segment: Segment, last_segment: bool, stage: int) -> set[int]:
    """:func:`assert_replicas_agree` for one run segment's records of one pipeline stage (iteration records and
    events are every stage's); returns the iterations checked."""
    checked: set[int] = set()
    where = f" (stage {stage})" if stage else ""
    generations, iterations = segment.published(), segment.iterations()
    rows: dict[int, dict[tuple[int, int, int], dict]] = defaultdict(dict)
    for r in segment.records:
        if r.get("kind") == "state_checksums":
            key = (r.get("generation", 0), r["replica"], r["tp_rank"])
            assert key not in rows[r["iteration"]], f"iteration {r['iteration']}{where}: {key} reported twice"
            rows[r["iteration"]][key] = r
    interrupted = interrupted_iterations(segment, last_segment=last_segment)
    for iteration, record in sorted(iterations.items()):
        widths = record["tp_per_replica"]
        generation = record.get("generation", 0)
        if generations:
            topology = generations[generation]["topology"]
            assert _widths(topology, len(widths)) == widths, (
                f"iteration {iteration}{where}: tp_per_replica {widths}, but generation {generation} has "
                f"{_widths(topology, len(widths))}")
        reports = rows.get(iteration, {})
        for g, replica, tp_rank in reports:
            live = _live_tp_ranks(_stage_topology(generations[g]["topology"], stage)) if generations else {
                (rep, t) for rep, w in enumerate(widths) for t in range(_stage_width(w, stage))}
            assert (replica, tp_rank) in live, (
                f"iteration {iteration}{where}: a report from {(replica, tp_rank)}, which is not live in generation {g}")
        due_in, required = _required_reporters(segment, iteration, stage)
        missing = sorted(required - {(rep, t) for g, rep, t in reports if g == due_in})
        if missing:
            assert iteration in interrupted, (
                f"iteration {iteration}{where}: no state checksums from (replica, TP rank) {missing} in generation "
                f"{due_in}; only the rows of {interrupted or 'no iteration'} may be missing")
            if not reports:
                checked.add(iteration)  # nothing to compare, for the reason interrupted_iterations gives
                continue
        first_key = min(reports)
        first = reports[first_key]
        for who, other in sorted(reports.items()):
            differing = [k for k in set(first["checksums"]) | set(other["checksums"])
                         if first["checksums"].get(k) != other["checksums"].get(k)]
            assert not differing, (
                f"iteration {iteration}{where}: {who} differs from {first_key} in {sorted(differing)[:3]}")
            assert other["grad_norm"] == first["grad_norm"], (
                f"iteration {iteration}{where}: grad-norm bits differ between {who} and {first_key}")
        checked.add(iteration)
    complete = [i for i in sorted(iterations) if i in checked and i not in interrupted]
    if len(complete) > 1:  # the state changes: a report of something constant would agree trivially
        a, b = rows[complete[0]], rows[complete[-1]]
        assert a[min(a)]["checksums"] != b[min(b)]["checksums"], f"the state checksums never change{where}"
    return checked


# -- what a re-formation must move -----------------------------------------------------------------------------------

_STATE_TENSORS = {"adam": 2, "sgd": 1}
"""Per-element optimizer state tensors that move with a parameter: Adam's two moments, SGD's momentum."""
BYTES_PER_ELEMENT = 4
"""Every moved tensor travels in fp32: the parameter (under bf16 its fp32 main param) and its state."""


def unit_elements(model: dict, stage: int = 0, stages: int = 1) -> tuple[dict[str, int], int]:
    """Parameter elements of one unit of each TP-split family, and of the replicated parameters, for the GPT of
    this project's local layer spec (Megatron-Core's ``add_bias_linear`` default: every linear layer has a
    bias), written out from the model's dimensions:

    - ``heads`` (one query group, with its ``heads / groups`` query heads), per layer: its rows of the fused QKV
      weight (q heads, one k, one v, ``kv_channels`` each, by ``hidden``) and of the QKV bias, and its columns of
      the attention projection;
    - ``ffn`` (one hidden unit), per layer: its row of FC1 (two, gate and up, under a gated MLP) and their biases,
      and its column of FC2;
    - ``vocab`` (one row): the word embedding's, and the output layer's when untied.

    Replicated: per layer the two norms (weight, and bias under LayerNorm), the projection's and FC2's biases;
    the final norm; learned position embeddings (``max_position_embeddings`` or ``seq_length`` rows).

    With pipeline stages, of ``stage`` of ``stages``: its share of the layers; the word embeddings and the position
    embeddings in the first stage, the final norm and the output layer in the last (untied, or tied its copy of the
    word embeddings, which a re-formation moves as it moves the first stage's)."""
    h, layers = model["hidden_size"], model["num_layers"] // stages
    first, last = stage == 0, stage == stages - 1
    heads = model["num_attention_heads"]
    groups = model["num_query_groups"] or heads
    head_dim = model["kv_channels"] or h // heads
    per_group = heads // groups
    qkv_rows = (per_group + 2) * head_dim
    gate = 2 if model["gated_linear_unit"] else 1
    norm = h * (2 if model["normalization"] == "LayerNorm" else 1)
    positions = model["max_position_embeddings"] or model["seq_length"]
    per_unit = {
        "heads": layers * (qkv_rows * h + qkv_rows + h * per_group * head_dim),
        "ffn": layers * (gate * h + gate + h),
        "vocab": h * (first + last) if stages > 1 else h * (2 if model["untie_embeddings_and_output_weights"] else 1),
    }
    replicated = layers * (2 * norm + 2 * h) + norm * last + (
        positions * h if model["position_embedding_type"] == "learned_absolute" and first else 0)
    return per_unit, replicated


def unit_counts(model: dict) -> dict[str, int]:
    return {"heads": model["num_query_groups"] or model["num_attention_heads"],
            "ffn": model["ffn_hidden_size"] or 4 * model["hidden_size"], "vocab": model["vocab_size"]}


def _canonical_block(num_units: int, tp_base: int, slot: int) -> set[int]:
    """Block ``slot``: the ``slot``-th of ``tp_base`` contiguous runs of unit ids, larger runs first."""
    base, rest = divmod(num_units, tp_base)
    start = slot * base + min(slot, rest)
    return set(range(start, start + base + (1 if slot < rest else 0)))


def holdings(topology: dict) -> dict[tuple[int, int], dict[str, set[int]]]:
    """(replica, slot) -> family -> the units that slot's process holds: its canonical block but the units listed
    away from it, plus the units listed as dealt to it (the topology's ``dealt`` lists every unit not held by its own
    slot: a dead block's, or one a weighted replica's slot lent)."""
    tp_base, units = topology["tp_base"], topology["units"]
    out = {}
    for rep in topology["replicas"]:
        for slot in rep["slots"]:
            out[rep["index"], slot] = {
                family: (_canonical_block(n, tp_base, slot) - {u for u, _ in rep["dealt"].get(family, [])})
                | {u for u, s in rep["dealt"].get(family, []) if s == slot}
                for family, n in units.items()}
    return out


def _slot_of_rank(topology: dict) -> dict[int, tuple[int, int]]:
    return {rank: (rep["index"], slot)
            for rep in topology["replicas"] for slot, rank in zip(rep["slots"], rep["ranks"])}


def reformation_lower_bound(model: dict, optimizer: str, base: dict, new: dict, dead_ranks: Sequence[int],
                            fresh: bool) -> int:
    """Bytes a re-formation from ``base`` to ``new`` must move, from peers: every unit a process holds in ``new``
    and did not hold in ``base`` (a survivor keeps what it held; all a dead rank held is gone), and for a process
    new to the job (a joiner) also the replicated parameters; each with its optimizer state. Zero when ``fresh``:
    before the run's first committed iteration every rank builds its state itself (from the seed, or from the
    checkpoint the run starts from)."""
    if fresh:
        return 0
    if "stages" in base:  # units move inside a stage only
        return sum(_stage_lower_bound(model, optimizer, b, n, dead_ranks, p, len(base["stages"]))
                   for p, (b, n) in enumerate(zip(base["stages"], new["stages"])))
    return _stage_lower_bound(model, optimizer, base, new, dead_ranks)


def _stage_lower_bound(model: dict, optimizer: str, base: dict, new: dict, dead_ranks: Sequence[int], stage: int = 0,
                       stages: int = 1) -> int:
    """:func:`reformation_lower_bound` of one stage's topologies (the whole job's without stages)."""
    per_unit, replicated = unit_elements(model, stage, stages)
    ranks = _slot_of_rank(base)
    dead = {ranks[r] for r in dead_ranks if r in ranks}
    before, after = holdings(base), holdings(new)
    elements = 0
    for slot, held in after.items():
        kept = before.get(slot) if slot not in dead else None
        for family, units in held.items():
            elements += len(units - (kept[family] if kept else set())) * per_unit[family]
        if kept is None:
            elements += replicated
    return elements * BYTES_PER_ELEMENT * (1 + _STATE_TENSORS[optimizer])


def _member_slot(rep: dict, block: int) -> int:
    """The slot of replica ``rep`` (topology JSON) that is its member of sync group ``block``: slot ``block``, or
    the proxy of that dead block."""
    return block if block in rep["slots"] else dict(map(tuple, rep["proxies"]))[block]


def needed_shards(base: dict, new: dict, dead_ranks: Sequence[int], dp: int, instances: int) -> dict:
    """Under the distributed optimizer: (block, position, destination (replica, slot)) -> the (replica, slot)
    processes of ``base`` that could send it, for every shard a member of a sync group in ``new`` did not hold in
    ``base``. Megatron's instances: instance i is replicas ``[i·dp/k, (i+1)·dp/k)``, a replica's position is its
    place in its instance, and the holders of shard (block, position) are the block's sync members of the replicas
    at that position (one per instance). A possible source is a surviving holder: the destination's own replica's
    old member (a slot rejoining takes its shard back), else its twin in another instance."""
    per = dp // instances
    dead = {_slot_of_rank(base)[r] for r in dead_ranks}
    old = {rep["index"]: rep for rep in base["replicas"]}
    out = {}
    for rep in new["replicas"]:
        position = rep["index"] % per
        for block in range(new["tp_base"]):
            dst = (rep["index"], _member_slot(rep, block))
            before = old.get(rep["index"])
            if before is not None and (rep["index"], _member_slot(before, block)) == dst and dst not in dead:
                continue  # it held this shard and lives on
            sources = [(r, _member_slot(o, block)) for r, o in sorted(old.items()) if r % per == position]
            out[block, position, dst] = [src for src in sources if src not in dead]
    return out


def shard_bytes(model: dict, optimizer: str, tp_base: int, block: int, positions: int) -> Optional[int]:
    """Bytes of one shard of ``block`` (its parameter elements, as fp32, with the optimizer's state) where the
    whole of a block's buffers is one shard (one position per instance): the block's units and every replicated
    parameter; None where shards cut buffers (more positions: where the cut falls depends on Megatron's padding)."""
    if positions != 1:
        return None
    per_unit, replicated = unit_elements(model)
    counts = unit_counts(model)
    elements = sum(len(_canonical_block(counts[f], tp_base, block)) * per_unit[f] for f in per_unit) + replicated
    return elements * BYTES_PER_ELEMENT * (1 + _STATE_TENSORS[optimizer])


def check_shard_moves(event: dict, cfg: dict, launch: dict, base: dict, new: dict,
                      dead_ranks: Sequence[int]) -> list[str]:
    """What is wrong with a ``reformed`` event of a job with the distributed optimizer: its ``shard_moves`` (block,
    position, source and destination launch ranks, bytes) must be exactly the shards :func:`needed_shards` finds,
    each from one of its possible sources, each of the bytes :func:`shard_bytes` says (where it can say), and
    ``moved_bytes`` their sum. ``launch``: the segment's generation 0 topology (its ranks are launch ranks)."""
    p = cfg["parallel"]
    dp, instances = p["data_parallel_size"], p["num_distributed_optimizer_instances"]
    slot_of = _slot_of_rank(launch)
    g = event["generation"]
    moves = event.get("shard_moves")
    if moves is None:
        return [f"generation {g}: no shard_moves in the reformed event"]
    needed = needed_shards(base, new, dead_ranks, dp, instances)
    got = {(m["block"], m["position"], slot_of[m["dst"]]): m for m in moves}
    wrong = []
    if len(got) != len(moves) or sorted(got) != sorted(needed):
        wrong.append(f"generation {g}: shards moved (block, position, to) {sorted(got)}, needed {sorted(needed)}")
    for key, m in got.items():
        if key in needed and slot_of[m["src"]] not in needed[key]:
            wrong.append(f"generation {g}: shard {key[:2]} came from {slot_of[m['src']]}, not from a surviving "
                         f"holder {needed[key]}")
        expected = shard_bytes(cfg["model"], cfg["training"]["optimizer"], new["tp_base"], m["block"],
                               dp // instances)
        if expected is not None and m["bytes"] != expected:
            wrong.append(f"generation {g}: shard {key[:2]} moved {m['bytes']} bytes; its state is {expected} bytes")
    if sum(m["bytes"] for m in moves) != event["moved_bytes"]:
        wrong.append(f"generation {g}: moved {event['moved_bytes']} bytes, the shards listed are "
                     f"{sum(m['bytes'] for m in moves)} bytes")
    return wrong


class ReformationBoundError(AssertionError):
    """A re-formation moved other bytes than the units that had to move, or a rank reported another lower bound;
    ``result``: the job (every re-formation of it was checked)."""

    result: Optional[JobResult] = None


CHECKED_METRICS: set[Path] = set()
"""Metrics files already checked by :func:`run_job` (the conftest check skips them)."""


def job_config(run_dir: Path) -> dict:
    """The job's resolved configuration, as the launcher wrote it."""
    path = run_dir / "config.node0.json"
    assert path.is_file(), f"{path} not found: the model dimensions for the moved-bytes check come from it"
    return json.loads(path.read_text())


def check_reformations(records: list[dict], run_dir: Path) -> list[dict]:
    """Every ``reformed`` event moved exactly :func:`reformation_lower_bound` bytes, computed from the model's
    dimensions and the topologies in the ``generation_published`` events, and reported that bound (else
    :class:`ReformationBoundError`, once every re-formation is checked); the unit counts the controller published
    are the model's. Under the distributed optimizer whole shards move instead of units: the event's shard moves
    must be the needed ones, from surviving holders, and the bound is their state's bytes
    (:func:`check_shard_moves`)."""
    found, wrong = [], []
    for segment in segments(records):
        reformed = [r for r in segment.records if r.get("event") == "reformed"]
        if not reformed:
            continue
        cfg = job_config(run_dir)
        model, optimizer = cfg["model"], cfg["training"]["optimizer"]
        published, iterations = segment.published(), segment.iterations()
        for event in reformed:
            g = event["generation"]
            assert g in published, f"re-formed into generation {g}, which the controller never published"
            new = published[g]
            base = published[new["base"]]
            units = [_stage_topology(t["topology"], 0)["units"] for t in (new, base)]
            assert units[0] == units[1] == unit_counts(model), (
                f"generation {g}: unit counts {units[0]}, but the model has {unit_counts(model)}")
            fresh = not any(i < event["resume_iteration"] for i in iterations)
            sharded = cfg.get("parallel", {}).get("use_distributed_optimizer", False)
            if sharded and not fresh:  # whole shards move, and no units
                wrong += check_shard_moves(event, cfg, published[0]["topology"], base["topology"], new["topology"],
                                           new["dead_ranks"])
                p = cfg["parallel"]
                positions = p["data_parallel_size"] // p["num_distributed_optimizer_instances"]
                sizes = [shard_bytes(model, optimizer, new["topology"]["tp_base"], m["block"], positions)
                         for m in event.get("shard_moves", [])]
                # Where shards cut the buffers the harness has no geometry of its own: the figure the ranks computed
                # from Megatron's layout, which the moved bytes (received into the real objects) must equal.
                bound = event["lower_bound_bytes"] if None in sizes else sum(sizes)
            else:
                bound = reformation_lower_bound(model, optimizer, base["topology"], new["topology"],
                                                new["dead_ranks"], fresh)
            found.append({"generation": g, "moved_bytes": event["moved_bytes"], "bound": bound, "fresh": fresh})
            if event["moved_bytes"] != bound:
                wrong.append(f"generation {g} (from {new['base']}, dead ranks {new['dead_ranks']}, joined "
                             f"{new['joined']}): moved {event['moved_bytes']} bytes, but the units that had to move "
                             f"are {bound} bytes")
            if event["lower_bound_bytes"] != bound:
                wrong.append(f"generation {g}: the rank reported a lower bound of {event['lower_bound_bytes']} bytes; "
                             f"the units that had to move are {bound} bytes")
    if wrong:
        raise ReformationBoundError("; ".join(wrong))
    return found


def _healthy(topology, replica: int) -> bool:
    """Replica ``replica`` has every slot of every stage live in ``topology``."""
    from ntp_megatron.plan.stages import PipelineTopology

    stages = topology.stages if isinstance(topology, PipelineTopology) else (topology,)
    return all(any(rep.index == replica for rep in stage.replicas) and stage.is_healthy(replica) for stage in stages)


def _group_names(keys) -> set[str]:
    return {k.name() for k in keys}


def assert_groups_as_planned(result: JobResult, dp: Optional[int] = None, instances: int = 1,
                             healthy_tp_kept: bool = False) -> int:
    """Every re-formation of ``result``, every rank: the groups it made and kept (its ``reform_rank`` record) against
    the plan worked out from the published topologies (``ntp_megatron.plan.group_plan.event_plan``). Every group the plan
    makes was made (or kept from a formation cut short after the base, which made it), and nothing outside the
    rank's groups; besides the plan's, a rank may make a group its members'
    verdict refused (a collective left half-matched by the failure), never at an admission boundary (nothing in
    flight: exactly the plan's). Every member of a group did the same with it (made it, or kept the same
    incarnation). With ``healthy_tp_kept`` (failures that strand nothing in a healthy replica's TP
    group), a rank of a replica healthy in both generations (every stage) kept its TP group: the same incarnation, bound as many
    times in its model, DDP and optimizer, and made only sync groups. Returns how many such ranks were seen.
    ``dp``: the launch data-parallel size (default: the replicas of generation 0)."""
    from ntp_megatron.plan.group_plan import event_plan, rank_group_keys
    from ntp_megatron.plan.stages import PipelineTopology, load_topology

    published = {e["generation"]: e for e in result.events("generation_published")}
    topologies = {g: load_topology(e["topology"]) for g, e in published.items()}
    records = {(r["generation"], r["launch_rank"]): r for r in result.records if r.get("kind") == "reform_rank"}
    start = topologies[0]
    if dp is None:
        dp = len((start.stages[0] if isinstance(start, PipelineTopology) else start).replicas)
    launch_of = {start.slot_of(lr): lr for lr in range(start.world_size)}
    kept_tp = 0
    for event in result.events("reformed"):
        g = event["generation"]
        base_g = published[g]["base"]
        base, new = topologies[base_g], topologies[g]
        # Every member of a group did the same with it: all made it in this generation, or all kept one incarnation.
        seen: dict = {}
        for rank in range(new.world_size):
            record = records.get((g, launch_of[new.slot_of(rank)]))
            for k in rank_group_keys(new, rank, dp, instances):
                name = k.name()
                seen.setdefault(k, set()).add((name in record["groups_made"], record["groups_made_in"][name]))
        split = {k.label(): v for k, v in seen.items() if len(v) != 1}
        assert not split, f"generation {g}: members of a group disagree on it: {split}"
        for rank in range(new.world_size):
            identity = new.slot_of(rank)
            record = records.get((g, launch_of[identity]))
            assert record is not None, f"generation {g}: no reform_rank record from {identity}"
            plan = event_plan(base, new, identity, dp=dp, instances=instances)
            made, kept = set(record["groups_made"]), set(record["groups_kept"])
            where = f"generation {g}, {identity}"
            # A group the plan makes was made, or kept from a formation after the base that was cut short (made
            # there by the same members).
            assert all(name in made or base_g < record["groups_made_in"][name] < g for name in _group_names(plan.make)), (
                where, "a group whose members changed was kept", record)
            if event["joined"]:
                assert made <= _group_names(plan.make), (where, "made more than the plan at a boundary", record)
            replica = identity[0]
            if not healthy_tp_kept or not (_healthy(base, replica) and _healthy(new, replica)):
                continue
            tp = f"tp[{identity[2] if len(identity) > 2 else 0}]"
            before = records.get((base_g, launch_of[identity]))
            assert tp in kept and all(name.startswith("sync") for name in made), (where, record)
            assert before is not None and record["groups_made_in"][tp] == before["groups_made_in"][tp], (
                where, "its TP group is another incarnation", before, record)
            assert record["tp_references"] == before["tp_references"] > 0, (where, before, record)
            kept_tp += 1
    return kept_tp
