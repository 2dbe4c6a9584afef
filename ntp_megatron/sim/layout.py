"""Where each replica's TP groups sit: the map from GPUs to TP groups, domains and DP replicas.

GPUs are numbered domain by domain. A domain of ``domain_size`` GPUs holds ``domain_size / tp`` TP groups of
consecutive GPUs. With placement ``fixed``, TP group ``j`` is stage ``j % pp`` of replica ``j // pp``, so a
replica occupies ``pp`` consecutive TP groups, which may fill several domains (TP = domain size, PP > 1) or
share one (TP < domain size); packing re-assigns groups to replicas (placement.py). The job's domains come
first, then the spare domains; any further domains of the cluster are idle and never simulated, since
nothing that happens there changes the job.
"""

from __future__ import annotations

from dataclasses import dataclass

from ntp_megatron.config.files import ConfigError
from ntp_megatron.sim.config import Cluster


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    domain_size: int
    spare_domains: int
    idle_domains: int

    @property
    def groups_per_domain(self) -> int:
        return self.domain_size // self.tp

    @property
    def job_groups(self) -> int:
        return self.dp * self.pp

    @property
    def job_domains(self) -> int:
        return self.job_groups // self.groups_per_domain

    @property
    def active_domains(self) -> int:
        """Job plus spare domains: the only GPUs whose failures matter."""
        return self.job_domains + self.spare_domains

    @property
    def active_gpus(self) -> int:
        return self.active_domains * self.domain_size

    def describe(self) -> dict:
        return {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "domain_size": self.domain_size,
            "groups_per_domain": self.groups_per_domain,
            "job_domains": self.job_domains,
            "spare_domains": self.spare_domains,
            "idle_domains": self.idle_domains,
            "job_gpus": self.job_groups * self.tp,
            "active_gpus": self.active_gpus,
        }


def build_layout(c: Cluster) -> Layout:
    """Pick DP when not given: as many replicas as fit in whole domains beside the spares."""
    domains = c.gpus // c.domain_size
    usable_gpus = (domains - c.spare_domains) * c.domain_size
    dp = c.dp
    if dp is None:
        dp = usable_gpus // (c.tp * c.pp)
        while dp > 0 and (dp * c.pp * c.tp) % c.domain_size:
            dp -= 1
        if dp == 0:
            raise ConfigError(
                f"cluster: a replica of tp*pp={c.tp * c.pp} GPUs does not fit in whole domains "
                f"of the {usable_gpus} GPUs beside the spares"
            )
    job_domains = dp * c.pp * c.tp // c.domain_size
    return Layout(
        tp=c.tp,
        pp=c.pp,
        dp=dp,
        domain_size=c.domain_size,
        spare_domains=c.spare_domains,
        idle_domains=domains - job_domains - c.spare_domains,
    )
