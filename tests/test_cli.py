"""The command line, run as real processes."""

import json
import subprocess
import sys

import pytest
import yaml

from heterorl.policies import load_policy
from heterorl.runs import read_metrics
from heterorl.tasks import make_task
from tests.conftest import ENV, run_cli


def test_help_names_every_command():
    out = run_cli("--help")
    assert out.returncode == 0
    for command in ("demo", "sft", "rl", "bench", "keys"):
        assert command in out.stdout


def test_dry_run_prints_the_resolved_config():
    out = run_cli("demo", "--dry-run", "loss.name=grpo", "rollout.temperature=0.7")
    assert out.returncode == 0, out.stderr
    assert "name: grpo" in out.stdout and "temperature: 0.7" in out.stdout
    assert "name: arithmetic" in out.stdout and "answer_format: digits" in out.stdout  # the demo: add3


@pytest.mark.parametrize("args, message", [
    (["rl", "rl.stepz=3"], "`rl.stepz`"),
    (["sft", "sft.steps=x"], "`sft.steps`"),
    (["sft", "--config", "/nonexistent.yaml"], "does not exist"),
    (["rl", "task.name=chess", "rl.steps=1"], "chess"),
    (["rl", "loss.name=nope", "rl.steps=1", "rl.base=maze-sft-base", "logging.wandb_mode=disabled"], "nope"),
    (["rl", "rl.base=/nonexistent/policy", "logging.wandb_mode=disabled"], "/nonexistent/policy"),
    (["rl", "--config", "my_run.yaml"], "my_run.yaml does not exist here"),
    (["rl", "task.reward_timeout_s=0"], "`task.reward_timeout_s`"),
])
def test_bad_input_exits_2_with_a_message(args, message, tmp_path):
    out = run_cli(*args, f"logging.run_dir={tmp_path / 'run'}")
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert message in out.stderr and "Traceback" not in out.stderr


def test_sft_end_to_end_writes_policy_logs_and_wandb(tmp_path):
    policy = tmp_path / "policy"
    out = run_cli("sft", "sft.steps=12", "sft.eval_every=6", "sft.batch_size=16", "task.options.size=3",
                   "task.options.eval_size=32", "policy.tiny.hidden_size=32", "policy.tiny.num_layers=1",
                   "policy.tiny.intermediate_size=64", f"sft.output={policy}",
                   f"logging.run_dir={tmp_path / 'run'}", "logging.progress=false")
    assert out.returncode == 0, out.stderr
    assert "held-out greedy success" in out.stdout
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 13))
    assert records[0]["sft/loss"] > records[-1]["sft/loss"]
    assert [r["step"] for r in records if "eval/success" in r] == [6, 12]
    summary = json.loads((policy / "sft_summary.json").read_text())
    assert summary["steps"] == 12 and summary["config"]["sft"]["steps"] == 12
    model, tokenizer = load_policy(str(policy))
    assert tokenizer.decode(tokenizer("S.#\n>")["input_ids"]) == "S.#\n>"
    # wandb ran for real, offline, inside the run directory
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].rglob("*.wandb"))


def test_keys_makes_a_curve_pair_and_never_overwrites_one(tmp_path):
    import zmq.auth

    out = run_cli("keys", "--name", "worker-7", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    public, secret = zmq.auth.load_certificate(str(tmp_path / "worker-7.key_secret"))
    assert len(public) == len(secret) == 40  # Z85 of 32-byte keys
    assert zmq.auth.load_certificate(str(tmp_path / "worker-7.key"))[1] is None  # the public file holds no secret
    assert (tmp_path / "worker-7.key_secret").stat().st_mode & 0o077 == 0
    again = run_cli("keys", "--name", "worker-7", "--out", str(tmp_path))
    assert again.returncode == 2 and "exists" in again.stderr


def test_a_missing_config_names_the_packaged_ones_and_a_packaged_name_still_works(tmp_path):
    out = run_cli("sft", "--config", "my_run.yaml", cwd=tmp_path)
    assert out.returncode == 2 and "reinstall" not in out.stderr
    assert f"my_run.yaml does not exist here ({tmp_path})" in out.stderr
    assert ("packaged configs: add3_rl.yaml, add3_sft.yaml, arith_rl.yaml, arith_sft.yaml, calculator_rl.yaml, "
            "calculator_sft.yaml, demo.yaml, maze4_rl.yaml, maze4_sft.yaml, maze_rl.yaml, maze_sft.yaml") in out.stderr
    out = run_cli("rl", "--config", "maze4_rl.yaml", "--dry-run", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["rl"]["base"] == "maze4-sft-base"


@pytest.mark.parametrize("args, message", [
    (["train", "--workers", "0", "--dry-run"], "argument --workers: '0': must be > 0"),
    (["train", "--workers", "-3", "--dry-run"], "argument --workers: '-3': must be > 0"),
    (["compare", "--parallel", "0", "--dry-run"], "argument --parallel: '0': must be > 0"),
    (["compare", "--seeds", "0,x", "--dry-run"], "argument --seeds: '0,x': give comma-separated integers"),
    (["report", "SWEEP_DIR", "--seeds", "x"], "argument --seeds: 'x'"),
    (["rollout", "--connect", "tcp://127.0.0.1:9", "--connect-timeout", "-1"], "argument --connect-timeout: '-1'"),
    (["train", "--resume", "/nonexistent/run", "--config", "demo.yaml"], "drop --config demo.yaml"),
])
def test_a_bad_flag_exits_2_naming_it(args, message):
    out = run_cli(*args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert message in out.stderr and "Traceback" not in out.stderr


def test_task_name_on_the_command_line_drops_the_files_options_of_another_task(tmp_path):
    """The documented JSONL command (docs/TASKS.md): the packaged configs' maze options do not follow
    task.name=jsonl."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n')
    out = run_cli("rl", "--config", "maze_rl.yaml", "task.name=jsonl", f"task.options.path={data}",
                  "task.options.eval_size=1", "--dry-run")
    assert out.returncode == 0, out.stderr
    task = yaml.safe_load(out.stdout)["task"]
    assert task["options"] == {"path": str(data), "eval_size": 1}
    assert "its options (size, wall_density, min_path_len, eval_size, eval_seed) are dropped" in out.stderr
    assert make_task(task["name"], task["options"]).eval_problems()[0].answer in ("2", "4")
    # the same task keeps the file's options under the command line's
    out = run_cli("rl", "--config", "maze_rl.yaml", "task.name=maze", "task.options.size=4", "--dry-run")
    assert yaml.safe_load(out.stdout)["task"]["options"] == {"size": 4, "wall_density": 0.3, "min_path_len": 3,
                                                              "eval_size": 256, "eval_seed": 12345}
    assert "dropped" not in out.stderr


def test_rl_and_train_start_from_one_config_and_rl_keeps_its_own_run_dir():
    """One default: `rl` once started from maze_rl.yaml (GRPO, no delay) and `train` from demo.yaml (GEPO, delays),
    so the same overrides compared GRPO with GEPO under delay unawares."""
    rl = yaml.safe_load(run_cli("rl", "--dry-run").stdout)
    train = yaml.safe_load(run_cli("train", "--dry-run").stdout)
    assert rl["logging"].pop("run_dir") == "runs/rl" and train["logging"].pop("run_dir") == "runs/demo"
    assert rl == train
    ran = yaml.safe_load(run_cli("rl", "--dry-run", "logging.run_dir=mine").stdout)
    assert ran["logging"]["run_dir"] == "mine"


def test_run_headers_name_the_task_base_loss_execution_and_delay():
    from heterorl.cli import _config_path
    from heterorl.config import load_config
    from heterorl.runs import run_header

    cfg = load_config(_config_path("demo.yaml"))
    assert run_header(cfg, "train", "demo.yaml") == (
        "heterorl train: task arithmetic, base add3-sft-base, loss gepo, 40 steps x 32 prompts x 8; async, 2 workers, "
        "delay up uniform 0.1-1 s, down uniform 0.1-1 s (config demo.yaml)")
    assert run_header(cfg, "rl", "demo.yaml").startswith(
        "heterorl rl: task arithmetic, base add3-sft-base, loss gepo, 40 steps x 32 prompts x 8; synchronous in one "
        "process, no delay")
    cfg = load_config(_config_path("maze_rl.yaml"), ["delay.fixed_lag_steps=4", "runtime.execution=simulated"])
    assert "workers simulated on a virtual clock, delay a fixed lag of 4 versions" in run_header(cfg, "train", None)


def test_a_base_that_cannot_read_the_task_is_refused_with_the_sft_command_and_smollm2(tmp_path):
    out = run_cli("rl", "rl.base=maze-sft-base", "rl.steps=1", f"logging.run_dir={tmp_path / 'run'}")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "the base policy 'maze-sft-base' cannot read task 'arithmetic'" in out.stderr
    # the steps the shipped add3 base's recipe took, and the task's own options, so the command runs as printed
    assert ("heterorl sft task.name=arithmetic task.options.digits=3 task.options.ops=+ task.options.eval_size=512 "
            "task.options.eval_seed=54321 task.options.answer_format=digits sft.steps=1000 "
            "sft.output=runs/arithmetic-sft") in out.stderr
    assert "rl.base=smollm2" in out.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_keys_refuses_a_name_that_is_a_path(tmp_path):
    out_dir = tmp_path / "keys"
    for name in ("../x", "a/b", "..", "."):
        out = run_cli("keys", "--name", name, "--out", str(out_dir))
        assert out.returncode == 2 and "must be a plain file name" in out.stderr, (name, out.stderr)
    assert list(tmp_path.rglob("*.key*")) == []
    (tmp_path / "file").write_text("")
    out = run_cli("keys", "--name", "w", "--out", str(tmp_path / "file"))
    assert out.returncode == 2 and "is not a folder" in out.stderr and "Traceback" not in out.stderr


def test_compare_dry_run_lists_the_runs_and_checks_their_configs(tmp_path):
    out = run_cli("compare", "--losses", "gepo,grpo", "--delay", "32", "--seeds", "0,1", "--dry-run",
                  "--out", str(tmp_path / "cmp"))
    assert out.returncode == 0, out.stderr
    names = [line.split()[0] for line in out.stdout.splitlines() if "__d" in line]
    assert names == [f"{loss}__d{delay}__s{seed}" for seed in (0, 1) for delay in ("0", "32")
                     for loss in ("gepo", "grpo")]
    assert out.stdout.splitlines()[-1] == "8 runs; every config resolves"  # online next to the delay
    assert not (tmp_path / "cmp").exists()
    out = run_cli("compare", "--dry-run", "rl.stepz=3", "--out", str(tmp_path / "cmp"))
    assert out.returncode == 2 and "`rl.stepz`" in out.stderr


def test_train_stops_on_a_reward_that_never_returns(tmp_path):
    """A reward function stuck in the rollout workers: each worker gives up after task.reward_timeout_s and exits
    with the error, and `heterorl train` stops, printing its log tail."""
    config = tmp_path / "run.yaml"
    config.write_text(f"""
task: {{name: maze, options: {{size: 4, eval_size: 8}}, reward_fn: tests.stuck_reward:score, reward_timeout_s: 2}}
policy: {{tiny: {{hidden_size: 32, num_layers: 1, intermediate_size: 64}}}}
rollout: {{group_size: 2, max_tokens: 8}}
rl: {{base: null, steps: 3, prompts_per_step: 2, eval_every: 3}}
runtime: {{workers: 1, groups_per_call: 1, worker_restarts: 0}}
logging: {{run_dir: {tmp_path / "run"}, wandb_mode: disabled, progress: false}}
""")
    out = run_cli("train", "--config", str(config), timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "worker-" in out.stderr and "failed" in out.stderr
    assert "tests.stuck_reward:score did not return within 2 s" in out.stderr  # the stuck worker's log tail


def test_a_commands_warnings_are_written_above_its_bar_with_their_level():
    """The log's warnings (and Python's) while a command's bar is open: each on a line of its own, with its
    level, not into the bar's line; after it, logging is as it was (a process of its own: pytest holds the root
    logger's handlers)."""
    code = """
import logging, warnings
from heterorl.cli import _progress
progress, update = _progress(3, "rl", True)
update(1, {"rollout/reward_mean": 0.5})
logging.getLogger("heterorl.runs").warning("the starting policy solves none")
warnings.warn("a library's warning", FutureWarning, stacklevel=1)
progress.close()
assert logging.getLogger().handlers == []
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "\nheterorl: WARNING: the starting policy solves none\n" in out.stderr, out.stderr
    assert "heterorl: WARNING: " in out.stderr.split("solves none")[1] and "a library's warning" in out.stderr
