"""The NTP policies: a death becomes a new generation (node 0's controller), and the failed slot gets a replacement
process (:mod:`ntp_megatron.launch.rejoin`)."""

from __future__ import annotations

import time
from typing import Optional

from ntp_megatron.plan import memory_plan
from ntp_megatron.config.schema import JobConfig
from ntp_megatron.config.files import ConfigError
from ntp_megatron.elastic import commit, keys, publication
from ntp_megatron.elastic.controller import Controller, Death
from ntp_megatron.plan.succession import ShardedOptimizer
from ntp_megatron.launch.nodes import delete_rebalance_requests, new_rebalance_requests, publish_death, \
    rebalance_requests, request_rebalance
from ntp_megatron.launch.policy import DeathPolicy, LauncherView, tp_per_replica
from ntp_megatron.launch.rejoin import Rejoins, slot_live
from ntp_megatron.launch.preflight import pin_checkpoint_load
from ntp_megatron.plan.layout import TopologyError
from ntp_megatron.plan.stages import restart_layout
from ntp_megatron.plan.rebalance import Decision, RebalanceMonitor, groups_of


class NTPPolicy(DeathPolicy):
    def __init__(self, launcher: LauncherView) -> None:
        super().__init__(launcher)
        self.rejoins = Rejoins(launcher, self.admitted)
        ntp = launcher.cfg.ntp
        self.rebalance_monitor = RebalanceMonitor(ntp.rebalance_threshold, ntp.rebalance_window) if ntp.rebalance else None
        self._measured_generation = -1
        dims = memory_plan.dims_of(launcher.cfg)
        self._unit_costs = {p: memory_plan.unit_cost(dims, p) for p in range(dims.pipeline_stages)}

    def begin(self) -> None:
        if self.launcher.nodes.replacing:  # this launcher replaces a lost node: its slots join the running job
            self.rejoins.replace_node()
        self.rejoins.fill_spares()

    def slow_groups(self, topology, identity, completed: int) -> list[Decision]:
        """This node's ranks' compute times (from their heartbeats) to the rebalance monitor; the groups of
        ``identity``'s ranks to rebalance (``ntp.rebalance``). ``completed``: the newest formed generation, whose
        layout ``topology`` is: iterations before it do not count."""
        agent = self.launcher.agent
        if self.rebalance_monitor is None or agent is None or self.training_done:
            return []
        if completed != self._measured_generation:  # a new layout: only its own iterations count
            self._measured_generation = completed
            self.rebalance_monitor.reset(commit.committed(self.launcher.store))
        for launch_rank, measured in agent.compute_times.items():
            self.rebalance_monitor.observe(launch_rank, measured)
        last = self.launcher.cfg.training.train_iters
        # A decision takes effect two iterations later at the earliest (published, then at the next boundary).
        return [d for d in self.rebalance_monitor.decide(groups_of(topology, identity, self._unit_costs))
                if max(d.iterations) + 2 < last]

    def admitted(self, launch_rank: int) -> bool:
        """Whether ``launch_rank``'s slot is live in the newest published generation."""
        raise NotImplementedError

    def rank_finished(self, launch_rank: int) -> None:
        # A rank of the running generation completed the run (a retired one, of a dropped replica, exits 0 too).
        if self.admitted(launch_rank):
            self.training_done = True

    def idle(self) -> bool:
        return not self.rejoins.due

    def after(self) -> None:
        self.rejoins.step(self.training_done)

    def failed_replacements(self, deaths: list[Death]) -> list[Death]:
        """Handle the deaths of replacements (this node's, or on node 0 any node's) that died before they were
        admitted — the job never relied on them — and return the other deaths."""
        launcher = self.launcher
        stopped = {d.launch_rank for d in deaths if self.rejoins.stopped_at_end(d.launch_rank)}
        booting = [d for d in deaths
                   if ((self.rejoins.is_replacement(d.launch_rank) or d.launch_rank not in launcher.local_ranks)
                       and not self.admitted(d.launch_rank))
                   or d.launch_rank in stopped]  # admitted, never formed, stopped at the end
        for d in booting:
            keys.quietly(keys.withdraw_joining, launcher.store, d.launch_rank)  # so that it is never admitted
            self.replacement_died(d)
            if self.training_done or d.launch_rank in stopped:
                continue  # stopped by a launcher: the run completed before it was admitted (or formed)
            launcher.console.say(f"replacement for launch rank {d.launch_rank} (pid {d.pid}) {d.cause} before it was "
                             f"admitted; the job goes on without it")
            self.rejoins.schedule(d.launch_rank)
        return [d for d in deaths if d not in booting]

    def replacement_died(self, death: Death) -> None:
        """A replacement died before it was admitted (its death is handled above)."""


class ControllerPolicy(NTPPolicy):
    """Node 0: the controller absorbs deaths into new generations and admits replacements;
    ``ntp.on_unrecoverable: drop_replica`` or ``stop`` decides (in the controller) what it cannot absorb."""

    controller: Controller

    def begin(self) -> None:
        self.controller = self._controller()
        self._requests_seen = 0
        super().begin()

    def _controller(self) -> Controller:
        launcher, ntp = self.launcher, self.launcher.cfg.ntp
        start = launcher.start
        resume = {} if start is None else {"start_iteration": start.iteration,
                                           "start_consumed": start.samples(launcher.cfg.training.global_batch_size)}
        return Controller(launcher.store, launcher.cfg.topology(), ntp.min_tp, ntp.on_unrecoverable, launcher.console.say,
                          launcher.console.emit, dump_stacks=launcher.processes.dump_stacks, hold=launcher.console.hold,
                          release=launcher.console.release, sharded=ShardedOptimizer.of(launcher.cfg), **resume)

    def admitted(self, launch_rank: int) -> bool:
        c = self.controller
        return c.latest.rank_of(*c.identity[launch_rank]) is not None

    def live_launch_ranks(self) -> list[int]:
        return self.controller.live_launch_ranks()

    def counts(self, launch_rank: int) -> bool:
        return self.admitted(launch_rank) and launch_rank not in self.controller.dead

    def forget(self, launch_ranks: list[int]) -> None:
        # A replacement booting on a lost node never joins (a later one announces itself anew).
        for launch_rank in launch_ranks:
            keys.quietly(keys.withdraw_joining, self.launcher.store, launch_rank)

    def news(self, deaths: list[Death]) -> Optional[int]:
        if self.launcher.nodes.multi:
            deaths += self.launcher.nodes.remote_deaths(self.launcher.store)
        return None

    def handle(self, deaths: list[Death]) -> Optional[int]:
        deaths = self.failed_replacements(deaths)
        if not deaths:
            return None
        say = self.launcher.console.say
        for d in deaths:
            if d.launch_rank not in self.node_lost_ranks:  # a lost node's ranks: said once, as the node's loss
                say(f"rank {d.launch_rank} (pid {d.pid}) {d.cause}")
        reason = self.controller.handle(deaths)
        if reason is None:
            for d in deaths:
                if self.controller.identity[d.launch_rank][0] not in self.controller.unfit:
                    self.rejoins.schedule(d.launch_rank)  # a replica dropped for memory stays dropped
            return None
        say(reason)
        return self.unrecoverable(reason, deaths)

    def unrecoverable(self, reason: str, deaths: list[Death]) -> Optional[int]:
        """NTP cannot absorb ``deaths`` and the controller stopped the job (a rank's own error: the event names it)."""
        self.launcher.console.emit({"kind": "event", "event": "job_stopped", "reason": reason, "time": time.time(),
                                    **self.controller.error_stop})
        return self.stop_job(deaths)

    def after(self) -> None:
        super().after()
        self._rebalance()
        if self.training_done:
            return
        # Any node's replacements: each announces itself in the store. A lost node's come from a launcher started to
        # replace it, whatever ntp.rejoin_after_s says (a node's own replacements wait for it).
        store, c = self.launcher.store, self.controller
        candidates = c.identity if self.launcher.cfg.ntp.rejoin_after_s is not None else self.node_lost_ranks
        joining = [lr for lr in candidates
                   if not self.admitted(lr) and keys.quietly(keys.is_joining, store, lr, default=False)]
        ready = self._whole_nodes(joining)
        if ready and c.admit(ready):
            for lr in ready:
                if self.admitted(lr):  # the others wait (a replica dropped for memory comes back only whole)
                    keys.withdraw_joining(store, lr)
                    self.node_lost_ranks.discard(lr)  # back: a later death of it is a death like any other

    def _whole_nodes(self, ready: list[int]) -> list[int]:
        """``ready`` without the ranks of a replaced node until all of that node's lost ranks are ready: a node comes
        back in one generation, as it was lost in one."""
        launcher = self.launcher
        node_of = {lr: launcher.placement.device(*launcher.launch_slots[lr]).node for lr in self.node_lost_ranks}
        waiting = {node_of[lr] for lr in self.node_lost_ranks if not self.admitted(lr) and lr not in ready}
        return [lr for lr in ready if node_of.get(lr) not in waiting]

    def _rebalance(self) -> None:
        """Rebalance the groups with slow ranks: this node's (its own monitor) and other nodes' (their requests)."""
        c = self.controller
        if self.rebalance_monitor is None or c.forming():
            return
        local = {lr: c.identity[lr] for lr in self.launcher.local_ranks}
        decisions = self.slow_groups(c.latest, local, c.completed.generation) + self._requests()
        # Published now, a decision takes effect after the next committed iteration at the earliest.
        if decisions and commit.committed(self.launcher.store) + 2 < self.launcher.cfg.training.train_iters:
            c.rebalance(decisions)

    def _requests(self) -> list[Decision]:
        """Other nodes' rebalance requests since the last pass (one request when there are none), those made in the
        current layout (an older one's measurements say nothing of it)."""
        if not self.launcher.nodes.multi:
            return []
        store, c = self.launcher.store, self.controller
        numbers = new_rebalance_requests(store, self._requests_seen)
        if not numbers:
            return []  # none, or a request counted, its value not written yet: next pass
        self._requests_seen = numbers[-1]
        out = []
        for request in rebalance_requests(store, numbers):
            if request["generation"] == c.completed.generation:
                out += [d for d in map(Decision.from_json, request["decisions"])
                        if max(d.iterations) + 2 < self.launcher.cfg.training.train_iters]
        delete_rebalance_requests(store, numbers)
        return out

    def close(self) -> None:
        self.controller.close()


class RestartSurvivorsPolicy(ControllerPolicy):
    """``ntp.on_unrecoverable: restart`` (one node): what NTP cannot absorb restarts the job from the newest
    checkpoint on fresh processes for the slots that survived."""

    def unrecoverable(self, reason: str, deaths: list[Death]) -> Optional[int]:
        launcher, ck = self.launcher, self.launcher.cfg.checkpoint
        if any(d.error is not None for d in deaths):
            launcher.console.say("not restarting: the rank's own error would stop the restarted job again")
            return super().unrecoverable(reason, deaths)
        if ck.save is not None and launcher.restarts < ck.max_restarts and self._restart():
            return None
        launcher.console.say(f"no restart left ({launcher.restarts} of at most {ck.max_restarts} done)"
                         if launcher.restarts >= ck.max_restarts else "the job cannot restart")
        return super().unrecoverable(reason, deaths)

    def _restart(self) -> bool:
        """Stop every rank and start the job again from the newest checkpoint, on fresh processes for the slots
        that survived: each replica with its live slots, replicas below ``ntp.min_tp`` dropped
        (:func:`ntp_megatron.plan.layout.restart_layout`), the global batch and data order unchanged. The restarted
        job has its own launch ranks (0..), store and controller; injected failures that fired stay fired. False
        if no layout or configuration is possible (the caller stops the job)."""
        from ntp_megatron.training import checkpoint  # Megatron-Core (seconds to import) only when a job restarts

        launcher, c, p = self.launcher, self.controller, self.launcher.cfg.parallel
        live = [c.identity[lr] for lr in sorted(c.identity) if lr not in c.dead]
        try:
            dropped, dead_slots = restart_layout(p.tensor_model_parallel_size, p.data_parallel_size, live,
                                                 launcher.cfg.ntp.min_tp, p.pipeline_model_parallel_size)
            data = launcher.cfg.model_dump()
            data["ntp"]["dropped_replicas"] = dropped
            data["ntp"]["dead_slots"] = [f"{d[0]}:{d[1]}" + "".join(f"@{q}" for q in d[2:]) for d in dead_slots]
            own = checkpoint.restart_checkpoint(launcher.cfg.checkpoint)
            if own is not None:  # the run's own: all of it
                data["checkpoint"].update(load=str(own), finetune=False, no_load_optim=False, no_load_rng=False)
            cfg = JobConfig.model_validate(data)
            start = pin_checkpoint_load(cfg)
        except (TopologyError, ValueError, ConfigError) as exc:
            launcher.console.say(f"cannot restart on the surviving processes: {exc}")
            return False
        launcher.restarts += 1
        at = f"checkpoint {start.path} (iteration {start.iteration})" if start else "the start (no checkpoint yet)"
        launcher.console.say(f"restarting from {at} with {cfg.world_size} fresh processes for the surviving slots: TP "
                         f"per replica {tp_per_replica(cfg)} (restart {launcher.restarts} of at most "
                         f"{cfg.checkpoint.max_restarts})")
        launcher.processes.stop_all()
        c.close()
        fired = [spec for spec in launcher.failures
                 if keys.quietly(keys.has_fired, launcher.store, spec, default=False)]
        launcher.relaunch(cfg, start)  # a fresh store; every surviving slot keeps its device (one node)
        for spec in fired:
            keys.mark_fired(launcher.store, spec)
        self.controller = self._controller()
        if self.rebalance_monitor is not None:  # the new processes count their iterations from the checkpoint's
            self.rebalance_monitor = RebalanceMonitor(launcher.cfg.ntp.rebalance_threshold, launcher.cfg.ntp.rebalance_window)
        launcher.finished.clear()
        self.training_done = False
        launcher.respawn()
        self.rejoins.reset()
        if launcher.agent is not None:
            launcher.agent.restart(launcher.store)
        launcher.console.emit({"kind": "event", "event": "restarted", "restart": launcher.restarts, "time": time.time(),
                           "iteration": start.iteration if start else 0, "tp_per_replica": tp_per_replica(cfg)})
        return True


class WorkerNodePolicy(NTPPolicy):
    """A node other than 0: deaths go to node 0's controller through the store; replacements start here, on the
    dead slots' own devices, and node 0 admits them; node 0's stop ends the job here too. Slow ranks among this
    node's are found here (its launcher reads their heartbeats) and node 0 is asked to rebalance their groups."""

    _requested: Optional[tuple[int, list]] = None
    _topology_generation = -1
    _topology = None

    def admitted(self, launch_rank: int) -> bool:
        return slot_live(self.launcher.store, publication.newest, self.launcher.launch_slots[launch_rank])

    def news(self, deaths: list[Death]) -> Optional[int]:
        store = self.launcher.store
        if keys.quietly(keys.is_stopped, store, default=False):
            self.launcher.console.say(f"the job was stopped: {keys.stop_reason(store)}")
            self.launcher.processes.stop_all()
            return 1
        return None

    def handle(self, deaths: list[Death]) -> Optional[int]:
        for d in self.failed_replacements(deaths):
            self.launcher.console.say(f"rank {d.launch_rank} (pid {d.pid}) {d.cause}")
            publish_death(self.launcher.store, d, self.launcher.args.node_rank)
            self.rejoins.schedule(d.launch_rank)
        return None

    def replacement_died(self, death: Death) -> None:
        # Node 0 may have admitted it meanwhile: it decides.
        publish_death(self.launcher.store, death, self.launcher.args.node_rank)

    def after(self) -> None:
        super().after()
        self._request_rebalance()

    def _request_rebalance(self) -> None:
        """This node's TP groups with slow ranks, as a request to node 0's controller: once per layout and decision
        (node 0 may refuse one: a later, different decision in the same layout is asked again)."""
        if self.rebalance_monitor is None:
            return
        store = self.launcher.store
        try:
            completed = commit.newest_completed(store)  # -1 while generation 0 forms: never waits
            if completed < 0 or completed != publication.newest(store):
                return
            if completed != self._topology_generation:
                self._topology = publication.topology(store, completed)
                self._topology_generation = completed
            local = {lr: self.launcher.launch_slots[lr] for lr in self.launcher.local_ranks}
            decisions = [d.to_json() for d in self.slow_groups(self._topology, local, completed)]
            if decisions and (completed, decisions) != self._requested:
                request_rebalance(store, self.launcher.args.node_rank, completed, decisions)
                self._requested = (completed, decisions)
        except Exception:  # noqa: BLE001 - the root store goes away with the job; node 0's stop ends this node
            return
