"""`heterorl sft` and `heterorl rl` stop after the step in progress on a signal, with a checkpoint, and go on
with ``--resume`` as if they had never stopped."""

import json

import pytest
import torch

from heterorl.config import load_config, packaged
from heterorl.errors import HeteroRLError
from heterorl.loops.checkpoints import FOLDER, LoopCheckpoints, StopRequest, read_loop_state
from heterorl.loops.sft import run_sft
from heterorl.loops.sync_rl import run_sync_rl
from heterorl.runs import read_metrics, setup_run
from tests.conftest import interrupted_cli, run_cli

RL = ["rl.steps=4", "rl.eval_every=2", "rl.prompts_per_step=4", "rollout.group_size=4", "task.options.eval_size=16",
      "runtime.checkpoint_every=2", "logging.wandb_mode=disabled"]
SFT = ["sft.steps=6", "sft.eval_every=3", "sft.batch_size=8", "sft.stop_success=null", "task.options.eval_size=16",
       "runtime.checkpoint_every=2", "logging.wandb_mode=disabled"]


def _run(loop, config: str, overrides: list[str], run_dir, *, stop_at: int | None = None, resume: bool = False):
    """One leg of a run in ``run_dir``: stopped (as by a signal) after step ``stop_at``, or resumed; its result,
    each step's metrics and its final weights."""
    cfg = load_config(packaged(config), [*overrides, f"logging.run_dir={run_dir}"])
    command = "sft" if loop is run_sft else "rl"
    task, training, logger, _ = setup_run(cfg, command, cfg.rl.base if command == "rl" else cfg.policy.model,
                                          append=resume)
    stop, seen = StopRequest(), {}

    def progress(step: int, metrics: dict) -> None:
        seen[step] = dict(metrics)
        if step == stop_at:
            stop.request("SIGINT")

    checkpoints = LoopCheckpoints(run_dir, command, cfg.runtime.checkpoint_every,
                                  resume=read_loop_state(run_dir / FOLDER, command) if resume else None)
    try:
        result = loop(cfg, training, task, logger, progress, checkpoints=checkpoints, stop=stop)
    finally:
        logger.close()
    return result, seen, {k: v.clone() for k, v in training.model.state_dict().items()}


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("loop, config, overrides, stop_at", [
    (run_sync_rl, "add3_rl.yaml", RL, 3),  # stopped between two periodic checkpoints: the stop writes one
    (run_sft, "add3_sft.yaml", SFT, 3),
])
def test_a_stopped_loop_resumes_to_the_weights_and_metrics_of_an_uninterrupted_run(loop, config, overrides, stop_at,
                                                                                   tmp_path):
    whole, whole_seen, whole_weights = _run(loop, config, overrides, tmp_path / "whole")
    part, _, _ = _run(loop, config, overrides, tmp_path / "legs", stop_at=stop_at)
    assert part.stopped_by == "SIGINT" and part.steps == stop_at and whole.stopped_by is None
    assert read_loop_state(tmp_path / "legs" / FOLDER, "rl" if loop is run_sync_rl else "sft").step == stop_at
    rest, rest_seen, rest_weights = _run(loop, config, overrides, tmp_path / "legs", resume=True)
    assert sorted(rest_seen) == list(range(stop_at + 1, whole.steps + 1)) and rest.stopped_by is None
    for step in rest_seen:  # the same losses, rewards, evaluations and policy versions, bit for bit
        assert rest_seen[step] == whole_seen[step], step
    assert _same_weights(rest_weights, whole_weights)
    assert [h["eval/success"] for h in rest.history] == [h["eval/success"] for h in whole.history]
    # each step is logged once, across the legs
    steps = [r["step"] for r in read_metrics(tmp_path / "legs" / "metrics.jsonl")]
    assert steps == [r["step"] for r in read_metrics(tmp_path / "whole" / "metrics.jsonl")]


def test_a_checkpoint_resumes_only_the_command_that_wrote_it(tmp_path):
    _run(run_sft, "add3_sft.yaml", [*SFT, "sft.steps=2"], tmp_path)
    with pytest.raises(HeteroRLError, match=f"heterorl sft --resume {tmp_path}"):
        read_loop_state(tmp_path / FOLDER, "rl")
    (tmp_path / FOLDER / "loop_state.json").write_text("{not json")
    with pytest.raises(HeteroRLError, match="is not a loop checkpoint"):
        read_loop_state(tmp_path / FOLDER, "sft")


@pytest.mark.parametrize("args, message", [
    (["rl", "--resume", "{tmp}/nothing"], "no config.yaml there; is it a `heterorl rl` run dir?"),
    (["sft", "--resume", "{tmp}", "--config", "add3_sft.yaml"], "drop --config add3_sft.yaml"),
    (["rl", "--resume", "{tmp}"], "nothing to resume in {tmp}: no checkpoints/loop_state.json"),
])
def test_resume_refusals_name_the_fix(args, message, tmp_path):
    (tmp_path / "config.yaml").write_text((packaged("add3_rl.yaml")).read_text())
    out = run_cli(*[a.format(tmp=tmp_path) for a in args])
    assert out.returncode == 2 and message.format(tmp=tmp_path) in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_ctrl_c_stops_rl_after_its_step_with_the_resume_command_and_resume_finishes_it(tmp_path):
    """A real `heterorl rl` process and a real SIGINT (as a terminal's Ctrl-C): it ends its step, checkpoints,
    says the step, the checkpoint and the command that goes on, and exits 130; that command finishes the run."""
    run_dir = tmp_path / "run"
    args = ["rl", "--config", "add3_rl.yaml", *RL, "rl.steps=200", f"logging.run_dir={run_dir}",
            "logging.progress=false"]
    stopped = interrupted_cli(*args, run_dir=run_dir)
    err = stopped.stderr
    assert stopped.returncode == 130, err
    summary = json.loads((run_dir / "summary.json").read_text())
    reached = summary["steps"]
    assert summary["stopped_by"] == "SIGINT" and 1 <= reached < 200
    assert read_loop_state(run_dir / FOLDER, "rl").step == reached
    assert (f"stopped by SIGINT at step {reached} of 200; its last checkpoint is step {reached}" in err
            and f"To go on: heterorl rl --resume {run_dir}" in err), err
    assert "Traceback" not in err
    done = run_cli("rl", "--resume", str(run_dir), f"rl.steps={reached + 1}")
    assert done.returncode == 0, done.stderr
    assert "change:" in done.stdout and f"{run_dir}/config.yaml" in done.stdout  # the header names what it resumed
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]
    assert steps == list(range(reached + 2))
    assert json.loads((run_dir / "summary.json").read_text())["stopped_by"] is None
