"""Every grace period, wait and poll of the launcher and of the live path, named, documented and set from the job's
``timing`` section (``--set timing.peer_grace_s=8``), so an operator tunes them without editing code.

The launcher and every rank install the job's section once, as they start (:func:`use`); the code reads the values in
force at the moment it waits (:func:`current`). The defaults are what the suite runs with on this 2-core CPU machine.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TimingSection(BaseModel):
    """Grace periods, waits and polls (seconds unless named otherwise). The defaults suit CPU and GPU jobs alike;
    change one only with a reason (a slower store, a larger job)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True, frozen=True)

    # -- the launcher --
    exit_poll_s: float = Field(0.02, gt=0)
    """How often the launcher collects ranks that exited."""
    death_debounce_s: float = Field(0.05, ge=0)
    """Deaths within this long of each other are handled as one failure (one new generation)."""
    exit_delivery_s: float = Field(5.0, gt=0)
    """How long the launcher waits for the exit of a process it saw exit to be delivered (its relay reaps it)."""
    stop_grace_s: float = Field(5.0, gt=0)
    """How long a stopped rank has to exit, after SIGTERM and again after SIGKILL."""
    process_start_timeout_s: float = Field(60.0, gt=0)
    """How long the launcher's fork server may take to start a process."""
    fork_server_close_s: float = Field(5.0, gt=0)
    """How long the launcher, as it ends, waits for its fork server's reader thread once the server's socket is
    closed."""
    output_join_s: float = Field(2.0, gt=0)
    """How long the launcher, as it ends, waits for each of a rank's output threads to pass on the last lines and
    records the rank wrote (per thread)."""
    node_wait_fraction: float = Field(0.8, gt=0, le=1)
    """Of ``parallel.timeout_s``: how long node 0 waits for every node's launcher before it says which is missing
    (before the ranks' own rendezvous gives up)."""
    node_wait_quiet_s: float = Field(1.0, ge=0)
    """Nodes that connect within this long after node 0 started are not worth a "waiting for" line."""
    node_poll_s: float = Field(0.1, gt=0)
    """How often node 0 looks for the other nodes while it waits for them."""
    node_leave_wait_s: float = Field(5.0, ge=0)
    """How long node 0's launcher, as it ends, keeps its store up for the other nodes' launchers to read that the job
    ended and say how they leave (a node whose ranks all ended before the job did waits for that end)."""
    echo_settle_s: float = Field(2.0, ge=0)
    """NTP off, several nodes: how long a launcher waits for the other nodes' reports of a failure before it names
    the failed rank from what it has (the first death that is not an echo of another)."""
    echo_settle_poll_s: float = Field(0.02, gt=0)
    """How often it looks for those reports."""

    # -- the controller and the agent (launcher side of the live path) --
    report_wait_s: float = Field(10.0, ge=0)
    """How long a failure's report waits for every survivor to note it before it names those that did not."""
    report_poll_s: float = Field(0.01, gt=0)
    """How often the report reads the survivors' count while it waits."""
    report_full_check_s: float = Field(0.5, ge=0)
    """A full check of the survivors' notes that failed (the count includes ranks that died since) is not repeated
    sooner."""
    stopped_grace_s: float = Field(0.5, ge=0)
    """A rank stopped (SIGSTOP: ``T`` in ``/proc/<pid>/stat``) this long is fenced."""
    stall_refresh_s: float = Field(0.5, gt=0)
    """How often a launcher refreshes, in the root store, its ranks that wait on their peers (``ntp.progress_fence``:
    what the other launchers blame their own ranks for); emptied at once when no rank of it waits."""
    stall_fraction: float = Field(0.5, gt=0, le=1)
    """Of ``ntp.heartbeat_timeout_s`` (``ntp.progress_fence``), the patience: a rank that has waited on its peers this
    long is published as waiting, and a rank that holds such a wait up (behind it in a group it waits in) and has made
    no progress this long, in a phase of an iteration, is fenced."""
    stale_beats: float = Field(5.0, gt=1)
    """A heartbeat older than this many ``ntp.heartbeat_interval_s`` is stale (``ntp.progress_fence``): its rank's
    progress is unknown, not still, until a fresh one comes (a main thread holding the GIL delays the heartbeat thread
    by seconds; an old count is no sign the rank stopped working)."""
    relay_wait_s: float = Field(30.0, gt=0)
    """How long a relay thread blocks on one store call before it asks again (a wait for a generation's end lasts as
    long as the generation: one request to the root per node every this many seconds)."""
    relay_connect_timeout_s: float = Field(60.0, gt=0)
    """How long a node relay's store clients may take to connect."""
    relay_retry_s: float = Field(1.0, gt=0)
    """How long a relay thread whose store call failed waits before it connects again."""
    relay_stop_s: float = Field(5.0, gt=0)
    """How long a stopped node relay's threads have to end (their connections are shut down, so a thread in a store
    call fails out of it at once)."""
    node_beat_fraction: float = Field(0.25, gt=0, le=1)
    """Of ``ntp.heartbeat_timeout_s``: how often a node's relay writes the node's heartbeat to node 0's store; of
    ``ntp.node_timeout_s``: how often a node's launcher beats on its link to node 0's (a lost node)."""
    node_takeover_s: float = Field(10.0, gt=0)
    """A launcher started for a node whose launcher before it is not declared lost waits up to ``ntp.node_timeout_s``
    and this long more for node 0 to declare it lost, before it gives up in one line (two launchers must never run one
    node's slots)."""
    node_fence_poll_s: float = Field(0.2, gt=0)
    """How often a launcher of another node reads whether node 0 declared its node lost (a launcher that was
    stopped and resumed then stops its ranks and exits)."""
    port_connect_timeout_s: float = Field(1.0, gt=0)
    """How long one attempt to connect to a store's port may take while a client (a rank's, a relay's, a node
    launcher's) waits for the store to come up."""
    port_retry_s: float = Field(0.2, gt=0)
    """How long a client waiting for a store to come up pauses between two attempts to connect (a retry's pause,
    not a synchronisation)."""
    node_call_s: float = Field(5.0, gt=0)
    """How long a launcher of another node waits for node 0's store to answer one call (at most
    ``ntp.node_timeout_s``): a node 0 frozen with its port open answers nothing and closes nothing, and torch's client
    waits for it without bound; unanswered this long, node 0 is silent (:mod:`ntp_megatron.launch.root_watch`)."""
    node_probe_s: float = Field(1.0, gt=0)
    """How often a launcher of another node probes node 0's store's port once it stopped answering (until it answers
    again, or ``ntp.node_timeout_s`` has passed)."""

    # -- a rank --
    escape_grace_s: float = Field(0.05, ge=0)
    """How long after its generation ended a rank still waits on a collective of it. On a group whose sockets were
    shut down gloo's own error arrives within milliseconds; on a group left as it was (no dead member: it may go on)
    none comes, so a rank blocked there waits out this grace before it re-forms (``scripts/bench.sh --only recovery``
    measured 0.2 s on every recovery when it was 0.2)."""
    replica_grace_s: float = Field(5.0, ge=0)
    """``escape_grace_s`` for a rank of a replica the end named no dead member of, while it computes (forward,
    backward): its waits there are on its own replica's groups, whose members compute on and arrive. Given up
    after the short grace, a wait on a peer the machine was slow to schedule would leave a collective of the
    replica's tensor-parallel group half-matched, and the group made anew (:mod:`ntp_megatron.plan.group_plan`).
    Bounds a wait on a peer stuck there too: as long as the progress fence takes to fence a stuck rank (half of
    ``ntp.heartbeat_timeout_s`` by default); at 2 s a healthy peer slowed 30x in the iteration of a kill arrived too late
    on this machine."""
    peer_grace_s: float = Field(5.0, ge=0)
    """How long a rank waits for its generation to be marked over before it calls an exception its own. Bounds the
    time from a rank's own error to the stop of the job; far above the controller's reaction to a death."""
    echo_wait_s: float = Field(2.0, ge=0)
    """How long the controller (or the launcher, NTP off) waits for the report that names the cause when every death
    it has is a rank that only echoed another's error: the ranks of one failed save all raise at the same moment,
    but exit some milliseconds apart."""
    echo_poll_s: float = Field(0.01, gt=0)
    """How often, while it waits for that report, it reads the ranks' error reports again."""
    bring_wait_s: float = Field(1.0, gt=0)
    """How long a node's last voter waits on the root for the decision before it looks whether the generation ended
    without one."""
    watch_timeout_s: float = Field(3600.0, gt=0)
    """The store timeout of a generation watchdog's client (it waits on the generation's end, however long)."""
    watchdog_join_s: float = Field(5.0, gt=0)
    """How long a rank leaving an ended generation waits for the generation's watchdog thread to finish (its
    sockets are shut down: the thread's barrier probe fails at once)."""
    heartbeat_store_timeout_s: float = Field(30.0, gt=0)
    """The store timeout of a rank's heartbeat client, and of the clients it opens again after a broken connection;
    ten heartbeat intervals (``ntp.heartbeat_interval_s``) where that is longer."""
    generation_poll_s: float = Field(0.01, gt=0)
    """How often a rank looks for a newer generation or the end of one while it waits for it."""


_current = TimingSection()


def current() -> TimingSection:
    """The values in force in this process (the job's, once :func:`use` installed them; the defaults before)."""
    return _current


def use(section: TimingSection) -> None:
    """Install the job's ``timing`` section in this process (the launcher, a rank, a warm spare as it becomes one)."""
    global _current
    _current = section
