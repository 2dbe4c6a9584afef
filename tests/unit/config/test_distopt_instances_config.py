"""``parallel.num_distributed_optimizer_instances``: its defaults, its refusals (one line naming the key and the
allowed values, which the CLI turns into exit code 2 like every config error), Megatron's flag, and the DDP config
it reaches."""

from __future__ import annotations

import logging

import pytest

from ntp_megatron.config import schema
from ntp_megatron.config.schema import distributed_optimizer_instances, load_job_config
from ntp_megatron.config.files import ConfigError
from ntp_megatron.config.flags import translate
from ntp_megatron.training.model import ddp_config

KEY = "parallel.num_distributed_optimizer_instances"


def off(*overrides: str):
    return load_job_config(overrides=["ntp.enabled=false", *overrides])


@pytest.fixture
def warnings_seen(caplog, monkeypatch):
    """The config warnings logged, each as if for the first time in this process."""
    monkeypatch.setattr(schema, "_WARNED", set())
    caplog.set_level(logging.WARNING, logger=schema.__name__)
    return caplog


def test_without_ntp_the_default_is_one_instance_and_a_value_reaches_megatrons_ddp_config():
    assert off().parallel.num_distributed_optimizer_instances == 1
    assert off("parallel.use_distributed_optimizer=true",
               "parallel.data_parallel_size=4").parallel.num_distributed_optimizer_instances == 1
    cfg = off("parallel.use_distributed_optimizer=true", "parallel.data_parallel_size=4",
              "training.global_batch_size=16", f"{KEY}=2")
    assert cfg.parallel.num_distributed_optimizer_instances == 2
    ddp = ddp_config(cfg)
    assert ddp.num_distributed_optimizer_instances == 2 and ddp.use_distributed_optimizer
    assert ddp_config(off()).num_distributed_optimizer_instances == 1


@pytest.mark.parametrize("dp, expected", [(2, 2), (4, 2), (6, 2), (1, 1), (3, 1), (5, 1)])
def test_under_ntp_with_the_distributed_optimizer_the_default_keeps_a_twin_where_dp_is_even(dp, expected,
                                                                                         warnings_seen):
    got = distributed_optimizer_instances(None, ntp=True, distributed_optimizer=True, data_parallel_size=dp)
    assert got == expected
    warned = [r.getMessage() for r in warnings_seen.records]
    if expected == 1:
        assert len(warned) == 1 and KEY in warned[0] and "needs a checkpoint" in warned[0], warned
    else:
        assert not warned


def test_one_instance_under_ntp_with_the_distributed_optimizer_is_allowed_with_one_warning(warnings_seen):
    for _ in range(3):  # a config is validated more than once per process: one warning
        assert distributed_optimizer_instances(1, ntp=True, distributed_optimizer=True, data_parallel_size=4) == 1
    assert [r.levelname for r in warnings_seen.records] == ["WARNING"]
    assert distributed_optimizer_instances(4, ntp=True, distributed_optimizer=True, data_parallel_size=4) == 4
    assert distributed_optimizer_instances(1, ntp=False, distributed_optimizer=True, data_parallel_size=4) == 1
    assert distributed_optimizer_instances(None, ntp=True, distributed_optimizer=False, data_parallel_size=4) == 1
    assert len(warnings_seen.records) == 1, "only NTP with the distributed optimizer at one instance warns"


@pytest.mark.parametrize("overrides, expected", [
    (["parallel.use_distributed_optimizer=true", "parallel.data_parallel_size=4", "training.global_batch_size=16",
      f"{KEY}=3"], f"{KEY} (3) must divide parallel.data_parallel_size (4): allowed 1, 2, 4"),
    (["parallel.use_distributed_optimizer=true", "parallel.data_parallel_size=6", "training.global_batch_size=24",
      f"{KEY}=4"], f"{KEY} (4) must divide parallel.data_parallel_size (6): allowed 1, 2, 3, 6"),
    (["parallel.data_parallel_size=2", f"{KEY}=2"],
     f"{KEY} (2) needs parallel.use_distributed_optimizer: true; without it the only allowed value is 1"),
    ([f"{KEY}=0"], f"bad value for '{KEY}': Input should be greater than or equal to 1"),
])
def test_refusals_name_the_key_and_the_allowed_values(overrides, expected):
    with pytest.raises(ConfigError) as err:
        off(*overrides)
    assert "\n" not in str(err.value) and str(err.value).startswith(expected), str(err.value)


def test_megatrons_flag_sets_the_key():
    assert translate(["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]) == [
        "parallel.use_distributed_optimizer=true", f"{KEY}=2"]


def test_overlap_with_two_instances_on_gloo_warns_that_a_failure_would_end_the_run(warnings_seen):
    def cfg(*overrides: str):
        return load_job_config(overrides=["ntp.enabled=true", "parallel.use_distributed_optimizer=true",
                                          "parallel.data_parallel_size=2", "training.device=cpu", *overrides])

    cfg()
    cfg("parallel.overlap_grad_reduce=true", f"{KEY}=1")
    cfg("parallel.overlap_grad_reduce=true", "parallel.backend=nccl", "training.device=cuda")
    assert not [r for r in warnings_seen.records if "overlap_grad_reduce" in r.getMessage()]
    cfg("parallel.overlap_grad_reduce=true", "training.device=auto")  # the default config's device: gloo on CPU
    [warned] = [r.getMessage() for r in warnings_seen.records if "overlap_grad_reduce" in r.getMessage()]
    assert "the first failure would end the run" in warned and "parallel.overlap_grad_reduce: false" in warned
