"""`heterorl train` with a sharded learner (2 FSDP ranks under torchrun, gloo) and two workers, all real
processes: it trains, checkpoints as sharded folders, and resumes from them."""

import json

import pytest

from tests.conftest import maze_run, run_cli


@pytest.mark.slow
def test_a_sharded_learner_trains_checkpoints_in_shards_and_resumes(tmp_path):
    run = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(maze_run(run, 4, eval_size=32, eval_every=2,
                               runtime={"checkpoint_every": 2, "learner_ranks": 2, "learner_sharding": "fsdp"}))
    out = run_cli("train", "--config", str(config))
    assert out.returncode == 0, out.stdout + out.stderr
    checkpoints = run / "checkpoints"
    state = json.loads((checkpoints / "learner_state.json").read_text())
    assert state["step"] == 4 and state["weights"] == "checkpoint-000004.dcp"
    folder = checkpoints / state["weights"]
    assert sorted(p.name for p in folder.glob("rng-*.pt")) == ["rng-0.pt", "rng-1.pt"]  # both ranks wrote
    assert len(list(folder.glob("*.distcp"))) == 2
    assert json.loads((folder / "training.json").read_text())["world"] == 2
    assert not (checkpoints / "checkpoint-000000.dcp").exists()  # superseded folders are removed
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4
    # workers sampled with the gathered weights: at staleness 0 their log-probs are the learner's
    assert summary["engines"]["torch"]["mismatch_tokens"] > 0
    assert summary["engines"]["torch"]["mismatch_abs_max"] < 1e-4

    out = run_cli("train", "--resume", str(run), "rl.steps=6")
    assert out.returncode == 0, out.stdout + out.stderr
    learner_log = (run / "logs" / "learner.log").read_text()
    assert "resumed at step 4" in learner_log
    assert json.loads((checkpoints / "learner_state.json").read_text())["weights"] == "checkpoint-000006.dcp"
    assert json.loads((run / "summary.json").read_text())["steps"] == 6
