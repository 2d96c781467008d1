"""Configuration: YAML + dotted overrides, typed, with errors that name the key."""

from pathlib import Path

import pytest

from heterorl.config import Config, ConfigError, load_config, to_yaml
from tests.conftest import run_cli


def test_defaults_yaml_and_overrides_merge_in_order(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("loss:\n  name: gepo\nrollout:\n  temperature: 0.5\n  group_size: 4\n")
    cfg = load_config(path, ["rollout.temperature=0.7", "task.options.size=4"])
    assert isinstance(cfg, Config)
    assert cfg.loss.name == "gepo"  # from the file
    assert cfg.rollout.group_size == 4 and cfg.rollout.temperature == 0.7  # override wins
    assert cfg.task.options == {"size": 4}  # free-form options
    assert cfg.rl.steps == Config().rl.steps  # untouched default
    assert load_config(None, []).loss.name == "grpo"


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(None, ["optim.lr=3e-4", "logging.wandb_project=p"])
    path = tmp_path / "dump.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg


@pytest.mark.parametrize("overrides, message", [
    (["loss.nmae=gepo"], "`loss.nmae`"),
    (["nosuch=1"], "`nosuch`"),
    (["rl.steps=many"], "`rl.steps`"),
    (["rollout.temperature=hot"], "`rollout.temperature`"),
    (["optim.schedule=step"], "must be one of constant, cosine, linear"),
    (["rollout.group_size=0"], "`rollout.group_size` = 0: must be > 0"),
    (["rollout.temperature=-1"], "`rollout.temperature`"),
    (["loss.name"], "not of the form key=value"),
    (["loss.advantage=given"], "must be one of auto, group_centered, group_normalized, bnpo"),
    (["loss.advantage=bnpo", "loss.options.advantage=group_centered"], "disagree: set only one"),
    (["task.reward_timeout_s=0"], "`task.reward_timeout_s` = 0.0: must be a finite number of seconds > 0"),
    (["task.reward_timeout_s=-5"], "`task.reward_timeout_s` = -5.0"),
    (["task.reward_timeout_s=inf"], "`task.reward_timeout_s` = inf"),
    (["task.reward_timeout_s=nan"], "`task.reward_timeout_s` = nan"),
    (["rollout.max_turns=0"], "`rollout.max_turns` = 0: must be > 0"),
    (["rollout.max_episode_tokens=0"], "`rollout.max_episode_tokens` = 0: must be > 0"),
    (["rollout.env_step_timeout_s=0"], "`rollout.env_step_timeout_s` = 0.0: must be a finite number of seconds"),
    (["runtime.permit_calls=0"], "`runtime.permit_calls` = 0: must be > 0"),
    (['runtime.worker_prefix=["ip", "netns", "exec", "{host}"]'], "only {index}, {number} and {name}"),
    (["delay.fixed_lag_steps=2", "delay.down.bandwidth_bytes_per_s=1000"], "no bandwidth limit"),
    (["cluster.ray.workers_per_node=0"], "`cluster.ray.workers_per_node` = 0: must be >= 1"),
])
def test_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(None, overrides)


def test_reward_timeout_defaults_to_a_minute_and_null_means_no_limit():
    assert load_config(None, []).task.reward_timeout_s == 60.0
    assert load_config(None, ["task.reward_timeout_s=0.5"]).task.reward_timeout_s == 0.5
    assert load_config(None, ["task.reward_timeout_s=null"]).task.reward_timeout_s is None


def test_file_errors_name_the_key_and_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rl:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"`rl.stepz` \(.*bad.yaml\)"):
        load_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    path.write_text("seed: 1\nseed: 2\n")
    with pytest.raises(ConfigError, match="bad.yaml is not valid YAML: .*duplicate key seed"):
        load_config(path)


def test_loss_advantage_auto_defers_to_the_loss_and_a_name_overrides_it():
    assert load_config(None, ["loss.options.clip_eps=0.1"]).loss.resolved_options() == {"clip_eps": 0.1}  # auto
    assert load_config(None, ["loss.name=gepo", "loss.advantage=bnpo"]).loss.resolved_options() == {
        "advantage": "bnpo"}


@pytest.mark.parametrize("override, error", [
    ("loss.name=gepoo", r"`loss.name` = 'gepoo': is not a registered loss: choose one of .*\bgepo\b.*\bgrpo\b"),
    ("loss.options.clip_epz=0.1",
     r"`loss.options` = \{'clip_epz': 0.1\}: loss 'grpo' has no option\(s\) \['clip_epz'\]"),
    ("loss.options.clip_eps=-1", r"`loss.options` = \{'clip_eps': -1\}: clip_eps=-1: must be >= 0"),
])
def test_a_loss_name_or_option_that_does_not_exist_is_refused_when_the_config_loads(override, error):
    with pytest.raises(ConfigError, match=error):
        load_config(None, [override])


def test_dry_run_refuses_a_misspelt_loss_before_anything_starts():
    out = run_cli("train", "--dry-run", "loss.name=gepoo")
    assert out.returncode == 2 and "`loss.name` = 'gepoo': is not a registered loss" in out.stderr, out.stderr


@pytest.mark.parametrize("name", sorted(p.name for p in (Path(__file__).parents[1] / "heterorl" / "configs")
                                        .glob("*.yaml")))
def test_every_packaged_config_loads_and_names_what_it_starts_from(name):
    from heterorl.config import packaged
    from heterorl.policies import SHIPPED

    cfg = load_config(packaged(name))
    if cfg.rl.base is not None:  # a run config: it starts from a policy the package ships
        assert cfg.rl.base in SHIPPED, (name, cfg.rl.base)


_EXPERIMENTS = Path(__file__).parents[1] / "experiments" / "configs"


@pytest.mark.parametrize("name", sorted(p.name for p in _EXPERIMENTS.glob("*.yaml")))
def test_every_experiment_config_loads(name, tmp_path):
    """A sweep spec resolves every cell to a valid run config; any other file there is a valid run config."""
    import yaml

    from heterorl.sweeps.runner import SweepRunner

    path = _EXPERIMENTS / name
    if "losses" in yaml.safe_load(path.read_text()):
        runner = SweepRunner(path, out=tmp_path / "out")
        assert runner.cells and all(runner.resolve(cell) for cell in runner.cells[:3])
    else:
        load_config(path)


def test_gpu_placement_and_vllm_keys_are_checked():
    cfg = load_config(overrides=['runtime.worker_devices=[1,"2,3"]', "runtime.learner_devices=0",
                                 "runtime.vllm_max_model_len=1024"])
    assert cfg.runtime.worker_devices == ["1", "2,3"] and cfg.runtime.learner_devices == "0"
    with pytest.raises(ConfigError, match=r"runtime.worker_devices.*cuda:1.*device indices"):
        load_config(overrides=["runtime.worker_devices=[cuda:1]"])
    with pytest.raises(ConfigError, match="runtime.learner_devices"):
        load_config(overrides=["runtime.learner_devices=gpu0"])
    with pytest.raises(ConfigError, match=r"vllm_gpu_memory_utilization.*\(0, 1\]"):
        load_config(overrides=["runtime.vllm_gpu_memory_utilization=1.5"])
    with pytest.raises(ConfigError, match="vllm_max_model_len"):
        load_config(overrides=["runtime.vllm_max_model_len=0"])


def test_the_group_timeout_is_a_transport_key_and_the_old_buffer_key_is_still_read(caplog):
    assert load_config(None).transport.group_timeout_s == 600.0
    with caplog.at_level("WARNING", logger="heterorl.config"):
        cfg = load_config(None, ["buffer.partial_group_timeout_s=30"])
    assert (cfg.transport.group_timeout_s, cfg.buffer.partial_group_timeout_s) == (30.0, 30.0)  # the old mirrors
    assert "`buffer.partial_group_timeout_s` is deprecated" in caplog.text
    assert "`transport.group_timeout_s`" in caplog.text
    both = ["buffer.partial_group_timeout_s=30", "transport.group_timeout_s=30"]
    assert load_config(None, both).transport.group_timeout_s == 30  # the same value twice: no conflict
    with pytest.raises(ConfigError, match="buffer.partial_group_timeout_s.*transport.group_timeout_s.*disagree"):
        load_config(None, ["buffer.partial_group_timeout_s=30", "transport.group_timeout_s=45"])
    with pytest.raises(ConfigError, match="transport.group_timeout_s"):
        load_config(None, ["transport.group_timeout_s=0"])
    caplog.clear()
    cfg = load_config(None, ["transport.group_timeout_s=45"])
    assert cfg.buffer.partial_group_timeout_s == 45 and "deprecated" not in caplog.text


def test_the_config_a_learner_sends_its_workers_is_in_the_form_the_previous_release_reads():
    """A worker of the previous release must still join: the config in ``ready`` names no key it does not know
    (the group timeout travels as the deprecated key it mirrors), and it loads back to the same run config."""
    import yaml

    from heterorl.runtime.learner import learner_settings

    cfg = load_config(None, ["transport.group_timeout_s=45", "loss.name=gepo"])
    sent = learner_settings(cfg)["config"]
    data = yaml.safe_load(sent)
    assert "group_timeout_s" not in data["transport"] and data["buffer"]["partial_group_timeout_s"] == 45
    # the learner's own bounds, new since that release, stay home
    assert not {"max_ids_per_key", "group_deadline_min_s", "permit_lease_s", "permit_lease_min_s", "probation_permits",
                "max_refusals_per_s", "throttle_s", "throttles_before_disconnect", "max_layouts",
                "weights_bytes_in_flight", "weights_bytes_in_flight_per_worker"} & set(data["transport"])
    assert not {"max_log_ratio", "max_abs_reward", "max_group_weight"} & set(data["rl"])
    assert "worker_restarts" not in data["runtime"]
    assert not {"max_turns", "max_episode_tokens", "env_step_timeout_s"} & set(data["rollout"])  # (at defaults)
    assert to_yaml(load_config(text=sent)) == to_yaml(cfg)


def test_a_key_s_scope_on_its_field_decides_whether_workers_receive_it():
    """What a learner sends is derived from the fields: a learner-only key (or section) never travels, a key new
    in this release travels once set, every other key always."""
    from dataclasses import fields, is_dataclass

    from heterorl.config import to_worker_dict
    from heterorl.config.scope import LEARNER_ONLY, SCOPE, SENT_WHEN_SET

    def scopes(section, prefix=""):
        for f in fields(section):
            value, key = getattr(section, f.name), prefix + f.name
            yield key, f.metadata.get(SCOPE, "shared")
            if is_dataclass(value) and SCOPE not in f.metadata:
                yield from scopes(value, key + ".")

    def sent(data, key):
        for part in key.split("."):
            if not isinstance(data, dict) or part not in data:
                return False
            data = data[part]
        return True

    declared = dict(scopes(Config()))
    assert {"transport.group_timeout_s", "rl.max_log_ratio", "runtime.worker_restarts", "cluster"} <= {
        k for k, s in declared.items() if s == LEARNER_ONLY}
    at_defaults = to_worker_dict(Config())
    for key, scope in declared.items():
        assert sent(at_defaults, key) == (scope == "shared"), key
    when_set = [k for k, s in declared.items() if s == SENT_WHEN_SET]
    assert when_set and all(sent(to_worker_dict(load_config(None, [f"{k}=7"])), k) for k in when_set)
    learner_only = load_config(None, ["transport.permit_lease_s=90", "runtime.worker_restarts=0"])
    assert not sent(to_worker_dict(learner_only), "transport.permit_lease_s")
