"""Config schema, overrides and the one-line errors (pure, plus the real CLI for exit codes)."""

from __future__ import annotations


import pytest

from ntp_megatron.config.schema import CONFIG_DIR, DEFAULT_CONFIG, JobConfig, load_job_config
from ntp_megatron.config.files import ConfigError, parse_yaml
from ntp_megatron.config.flags import translate as translate_extra_args


def test_default_config_is_the_tiny_cpu_demo():
    """Without a config file the launcher reads ``configs/tiny_cpu.yaml``, the demo (not the schema's defaults: TP
    and DP of 1), and that file lists every key of the schema, section by section, so it doubles as the
    reference of every key."""
    cfg = load_job_config()
    assert DEFAULT_CONFIG.is_file() and DEFAULT_CONFIG.name == "tiny_cpu.yaml"
    assert (cfg.parallel.tensor_model_parallel_size, cfg.parallel.data_parallel_size) == (2, 2)
    assert (JobConfig().parallel.tensor_model_parallel_size, JobConfig().parallel.data_parallel_size) == (1, 1)
    assert cfg.parallel.world_size == 4
    assert cfg.data.mock and cfg.ntp.enabled and cfg.faults.inject == []
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads) == (2, 64, 8)
    listed = parse_yaml(DEFAULT_CONFIG.read_text())
    assert set(listed) == set(JobConfig.model_fields), sorted(set(JobConfig.model_fields) ^ set(listed))
    for section, info in JobConfig.model_fields.items():
        missing = sorted(set(info.annotation.model_fields) - set(listed[section] or {}))
        assert not missing, f"{DEFAULT_CONFIG.name} does not list {', '.join(f'{section}.{k}' for k in missing)}"


@pytest.mark.parametrize("path", sorted(p.name for p in CONFIG_DIR.glob("*.yaml")))
def test_shipped_job_configs_validate(path):
    load_job_config(CONFIG_DIR / path)


def test_ntp_is_on_unless_a_config_switches_it_off(tmp_path):
    """The schema's default is what the docs say: a YAML of the user's own without an ``ntp`` section runs NTP."""
    own = tmp_path / "own.yaml"
    own.write_text("training:\n  train_iters: 10\n")
    assert JobConfig().ntp.enabled and load_job_config(own).ntp.enabled
    own.write_text("ntp:\n  enabled: false\n")
    assert not load_job_config(own).ntp.enabled


def test_overrides_are_typed_and_nested():
    cfg = load_job_config(overrides=["training.train_iters=7", "model.hidden_dropout=0", "ntp.enabled=false",
                                     "data.data_path=[a, b]"])
    assert cfg.training.train_iters == 7 and cfg.model.hidden_dropout == 0.0 and not cfg.ntp.enabled
    assert cfg.data.data_path == ["a", "b"]


def test_slot_lists_stay_strings():
    """YAML 1.1 would read 1:3 as the base-60 number 63."""
    assert parse_yaml("[1:3, 0:2]") == ["1:3", "0:2"]
    assert parse_yaml("12") == 12 and parse_yaml("1.5e-3") == 1.5e-3


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model.hidden_sise=64", "unknown config key 'model.hidden_sise'; allowed keys here: num_layers, hidden_size"),
        ("trainig.train_iters=3", "unknown config key 'trainig'; allowed keys here: model, parallel, training"),
        ("parallel.backend=mpi", "bad value for 'parallel.backend': Input should be 'auto', 'gloo' or 'nccl' (got 'mpi')"),
        ("training.train_iters=0", "bad value for 'training.train_iters': Input should be greater than or equal to 1 (got 0)"),
        ("model.num_attention_heads=7", "model.num_attention_heads (7) must divide model.hidden_size (64)"),
        ("training.global_batch_size=10", "training.global_batch_size (10) must be a multiple of"),
        ("training.train_iters=5", "training.lr_warmup_iters (5) must be below the decay length, training.train_iters"),
        ("ntp.dead_slots=[1:1]", "ntp.dead_slots needs ntp.enabled: true"),
        ("ntp.degraded_batch=half", "bad value for 'ntp.degraded_batch': Input should be 'full' or 'proportional'"),
        ("ntp.on_unrecoverable=retry", "bad value for 'ntp.on_unrecoverable': Input should be 'drop_replica', "
                                       "'stop' or 'restart' (got 'retry')"),
        ("ntp.on_unrecoverable=restart", "ntp.on_unrecoverable 'restart' needs checkpoint.save and "
                                         "checkpoint.save_interval"),
        ("ntp.heartbeat_timeout_s=0.1", "ntp.heartbeat_timeout_s (0.1) must exceed ntp.heartbeat_interval_s (0.2)"),
        ("ntp.node_timeout_s=5", "ntp.node_timeout_s (5.0) must be at least ntp.heartbeat_timeout_s (10.0)"),
        ("model.init=random", "bad value for 'model.init': Input should be 'megatron' or 'layout_free' (got 'random')"),
    ],
)
def test_errors_name_the_key_and_what_is_allowed(override, expected):
    with pytest.raises(ConfigError) as err:
        load_job_config(overrides=["ntp.enabled=false", override])
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(expected), message


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["ntp.dead_slots=[2:0]"], "ntp topology: dead slot 2:0: replica 2 out of range 0..1"),
        (["ntp.dead_slots=[x]"], "ntp.dead_slots: expected 'replica:slot' like '1:3', or 'replica:slot@stage' like "
                                 "'1:3@1', got 'x'"),
        (["ntp.dead_slots=[0:0,0:1]"], "ntp topology: replica 0 has no live slot"),
        (["ntp.dropped_replicas=[0,1]"], "ntp topology: every replica (0..1) is dropped"),
        (["ntp.dropped_replicas=[2]"], "ntp topology: dropped replica 2 out of range 0..1"),
        (["ntp.min_tp=2", "ntp.dead_slots=[1:1]"], "ntp topology: replica 1 starts with 1 live slots, below ntp.min_tp (2)"),
        (["parallel.tensor_model_parallel_size=4", "model.num_query_groups=2"], "ntp topology: family 'heads' has 2 units"),
        (["parallel.use_distributed_optimizer=true", "ntp.dropped_replicas=[1]"],
         "ntp.dropped_replicas ([1]) needs parallel.num_distributed_optimizer_instances: 1 with "
         "parallel.use_distributed_optimizer (not 2: an instance would lack a replica)"),
        (["model.transformer_impl=transformer_engine"], "ntp.enabled needs model.transformer_impl: local"),
        (["checkpoint.async_save=true"], "checkpoint.async_save is not supported with ntp.enabled yet"),
    ],
)
def test_ntp_config_errors(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_job_config(overrides=["ntp.enabled=true", *overrides])
    assert str(err.value).startswith(expected), str(err.value)


PP2 = ["parallel.pipeline_model_parallel_size=2", "model.init=layout_free"]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["model.num_layers=3"], "parallel.pipeline_model_parallel_size (2) must divide model.num_layers (3): "
                                 "allowed 1, 3"),
        (["parallel.sequence_parallel=true"], "parallel.sequence_parallel is not supported with "
                                              "parallel.pipeline_model_parallel_size (2) above 1 yet"),
        (["parallel.use_distributed_optimizer=true"], "parallel.use_distributed_optimizer is not supported with "
                                                      "ntp.enabled and parallel.pipeline_model_parallel_size 2 yet"),
        (["parallel.overlap_grad_reduce=true"], "parallel.overlap_grad_reduce is not supported with ntp.enabled and "
                                                "parallel.pipeline_model_parallel_size 2 yet"),
        (["ntp.degraded_batch=proportional"], "ntp.degraded_batch 'proportional' is not supported with ntp.enabled "
                                              "and parallel.pipeline_model_parallel_size 2"),
        (["model.init=megatron"], "model.init 'megatron' is not supported with ntp.enabled and "
                                  "parallel.pipeline_model_parallel_size 2: use layout_free"),
        (["ntp.dead_slots=[1:0@2]"], "ntp topology: dead slot 1:0@2: stage 2 out of range 0..1"),
        (["ntp.dead_slots=[1:5@1]"], "ntp topology: dead slot 1:5@1: slot 5 out of range 0..1"),
        (["ntp.dead_slots=[2:0@1]"], "ntp topology: dead slot 2:0@1: replica 2 out of range 0..1"),
        (["ntp.dead_slots=[1:0,1:0@0]"], "ntp.dead_slots: slot '1:0@0' is listed twice ('1:0' and '1:0@0')"),
    ],
)
def test_pipeline_config_errors(overrides, expected):
    """With NTP, pipeline stages refuse what they do not support yet, each by name, and dead slots name their
    stage as the user wrote them."""
    with pytest.raises(ConfigError) as err:
        load_job_config(overrides=["ntp.enabled=true", *PP2, *overrides])
    message = str(err.value)
    assert "\n" not in message and message.startswith(expected), message


def test_a_dead_slot_listed_twice_is_named_as_written():
    with pytest.raises(ConfigError, match=r"ntp.dead_slots: slot '1:0' is listed twice$"):
        load_job_config(overrides=["ntp.enabled=true", "ntp.dead_slots=[1:0,1:0]"])


def test_sequence_parallel_with_stages_is_refused_without_ntp_too():
    with pytest.raises(ConfigError, match="parallel.sequence_parallel is not supported with "
                                          "parallel.pipeline_model_parallel_size"):
        load_job_config(overrides=["ntp.enabled=false", *PP2, "parallel.sequence_parallel=true"])


def test_degraded_start_sizes_the_world():
    cfg = load_job_config(overrides=["ntp.enabled=true", "parallel.tensor_model_parallel_size=4",
                                     "ntp.dead_slots=[1:3]"])
    assert cfg.world_size == 7
    assert [r.width for r in cfg.topology().only_stage.replicas] == [4, 3]
    assert cfg.unit_counts() == {"heads": 8, "ffn": 256, "vocab": 256}


def test_the_distributed_optimizer_starts_degraded_with_checkpoints_and_drops_replicas_with_one_instance():
    dist_opt = ["ntp.enabled=true", "parallel.use_distributed_optimizer=true", "parallel.tensor_model_parallel_size=2"]
    cfg = load_job_config(overrides=[*dist_opt, "ntp.dead_slots=[1:1]", "checkpoint.save=/tmp/ckpt",
                                     "checkpoint.load=/tmp/ckpt"])
    assert [r.width for r in cfg.topology().only_stage.replicas] == [2, 1]
    assert cfg.parallel.num_distributed_optimizer_instances == 2
    cfg = load_job_config(overrides=[*dist_opt, "ntp.dropped_replicas=[1]",
                                     "parallel.num_distributed_optimizer_instances=1"])
    assert [r.index for r in cfg.topology().only_stage.replicas] == [0]


def test_megatron_style_flags_become_overrides():
    assert translate_extra_args(["--train-iters", "20", "--tensor-model-parallel-size=1"]) == [
        "training.train_iters=20", "parallel.tensor_model_parallel_size=1"]
    assert translate_extra_args(["--data-path", "a/b_text_document"]) == [
        "data.mock=false", 'data.data_path=["a/b_text_document"]']
    with pytest.raises(ConfigError, match="unknown argument --no-such-flag"):
        translate_extra_args(["--no-such-flag", "1"])


def test_async_save_without_ntp():
    cfg = load_job_config(overrides=["ntp.enabled=false", "checkpoint.async_save=true"])
    assert cfg.checkpoint.async_save and not cfg.ntp.enabled


def test_the_timing_section_is_tuned_from_yaml_or_flags_and_reaches_the_code(tmp_path):
    """Every grace period, wait and poll is a key of ``timing`` (ntp_megatron/config/timing.py): set in YAML, by
    --set or by its flag; installed by :func:`timing.use`, what the code reads at the moment it waits."""
    from ntp_megatron.config import timing
    from ntp_megatron.config.flags import translate

    path = tmp_path / "job.yaml"
    path.write_text("timing:\n  peer_grace_s: 8.0\n")
    cfg = load_job_config(path, ["timing.report_wait_s=3", *translate(["--stop-grace-s", "7"])])
    assert (cfg.timing.peer_grace_s, cfg.timing.report_wait_s, cfg.timing.stop_grace_s) == (8.0, 3.0, 7.0)
    assert cfg.timing.bring_wait_s == timing.TimingSection().bring_wait_s
    before = timing.current()
    try:
        timing.use(cfg.timing)
        assert timing.current().peer_grace_s == 8.0
    finally:
        timing.use(before)
    with pytest.raises(ConfigError, match="timing.peer_grace"):
        load_job_config(None, ["timing.peer_grace=1"])
    with pytest.raises(ConfigError, match="timing.stop_grace_s"):
        load_job_config(None, ["timing.stop_grace_s=0"])
