"""Bounds on one group's weight in an update (docs/RELIABILITY.md, "Bounds on one group"): a group whose importance
weights or rewards are far outside any honest range is dropped and counted, and the rest of its batch trains; a
gradient that is not finite anyway skips its step, counted; metrics stay standard JSON."""

import copy
import json
import math

import pytest
import torch

import gepo
from heterorl.config import load_config, packaged
from heterorl.errors import ConfigError
from heterorl.loops.sync_rl import rollout_datums
from heterorl.policies import load_policy
from heterorl.runs import MetricsLogger, json_text, read_metrics
from heterorl.tasks import make_task_from
from heterorl.training.session import AdamParams, TrainingClient
from heterorl.training.step import BAD_BATCH, NO_SIGNAL, bounded, minibatches, optimize_batch

FLOOR = -49.99  # just above the contract's floor (MIN_LOGPROB = -50): every such trajectory is accepted


@pytest.fixture(scope="module")
def add3():
    """The add3 base, its config (GRPO, groups of 4, no warm-up) and 6 groups it sampled (seed 0), each given the
    rewards 1, 0, 1, 0 so that every group carries signal."""
    cfg = load_config(packaged("add3_rl.yaml"), ["rollout.group_size=4", "optim.warmup_steps=0"])
    task = make_task_from(cfg.task)
    model, tok = load_policy("add3-sft-base")
    sampler = TrainingClient(copy.deepcopy(model), tok).save_weights_and_get_sampling_client()
    datums, _ = rollout_datums(sampler, task, task.eval_problems()[:6], cfg, seed=0)
    for i, d in enumerate(datums):
        d.reward = float(i % 2 == 0)
    return cfg, model, tok, sampler.version, datums


def _train(add3, datums, **rl):
    """One `optimize_batch` from the base (seed 0): its metrics, what it skipped, and the weight change."""
    cfg, model, tok, version, _ = add3
    cfg = copy.deepcopy(cfg)
    for key, value in rl.items():
        setattr(cfg.rl, key, value)
    training = TrainingClient(copy.deepcopy(model), tok, seed=0)
    training.version = version  # the version that sampled the datums
    skipped = []
    metrics = optimize_batch(training, datums, cfg, total_updates=1, skipped=skipped)
    change = torch.cat([(p - q).detach().flatten() for p, q in zip(training.model.parameters(), model.parameters())])
    return metrics, skipped, change


def _hostile(datums):
    """The datums with group 0's behaviour log-probs at the floor: importance weights of about e^49 ≈ 5e20."""
    datums = copy.deepcopy(datums)
    for d in datums[:4]:
        d.behaviour_logprobs = [FLOOR] * len(d.behaviour_logprobs)
    return datums


def test_a_group_at_the_logprob_floor_is_dropped_and_the_honest_groups_train_as_without_it(add3):
    """Measured before the bound: GRPO's gradient norm was inf, clipping scaled every gradient by 0, the weights did
    not move, and the step still said ``optim/updates`` 1. Now the group is dropped before the loss, counted and
    handed back by its rows, and the honest groups' update is the one they make alone."""
    datums = add3[4]
    metrics, skipped, change = _train(add3, _hostile(datums))
    assert metrics["optim/updates"] == 1 and metrics["optim/dropped_groups"] == 1
    assert "optim/bad_batches" not in metrics and math.isfinite(metrics["optim/grad_norm"])
    assert [s.rows for s in skipped] == [[0, 1, 2, 3]] and "rl.max_log_ratio = 10" in skipped[0].reason
    assert bool(torch.isfinite(change).all())
    alone, _, honest = _train(add3, datums[4:])
    assert "optim/dropped_groups" not in alone
    assert float(honest.norm()) > 1e-2  # the honest groups do move the weights (measured 0.103)
    assert float((change - honest).norm()) < 1e-4 * float(honest.norm())  # measured 1.7e-6 of it (rounding)


def test_without_the_bound_a_gradient_that_is_not_finite_skips_its_step_and_says_so(add3):
    """The safety net behind the bound: with ``rl.max_log_ratio`` off, the hostile group makes GRPO's gradient norm
    inf; the step is skipped (no AdamW step, gradients zeroed), counted as a bad batch, never a silent zero update."""
    metrics, skipped, change = _train(add3, _hostile(add3[4]), max_log_ratio=None)
    assert metrics == {"optim/updates": 0, "optim/bad_batches": 1, "optim/skip_reason": BAD_BATCH}
    assert [s.rows for s in skipped] == [list(range(24))] and "gradient norm is inf" in skipped[0].reason
    assert float(change.abs().max()) == 0.0


def test_optim_step_with_a_gradient_that_is_not_finite_takes_no_step(add3):
    """The primitive itself: a finite loss (about -2e31) whose gradient norm overflows float32 leaves the weights,
    the step count and AdamW's state as they were, zeroes the gradients and says ``skipped``."""
    _, model, tok, version, datums = add3
    training = TrainingClient(copy.deepcopy(model), tok, seed=0)
    training.version = version
    out = training.forward_backward(datums[:4], lambda batch, _: ((batch.logprobs * batch.mask).sum() * 1e30, {}))
    assert math.isfinite(out.result().loss)
    step = training.optim_step(AdamParams(learning_rate=1e-3)).result()
    assert step.skipped and step.step == 0 and not math.isfinite(step.grad_norm)
    assert training.step == 0 and not training.optimizer.state
    assert all(p.grad is None for p in training.model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(training.model.parameters(), model.parameters()))


def _gepo_gradients(rewards: list[float], max_abs_reward: float | None) -> torch.Tensor:
    """(rows,) norm of each row's gradient of the GEPO loss (seed 0, on-policy: behaviour = learner log-probs) with
    respect to its log-probs, for two groups of 4 rows of 6 tokens: rewards 1, 0, 1, 0 and ``rewards``."""
    torch.manual_seed(0)
    logprobs = (-torch.rand(8, 6) * 2).requires_grad_()
    batch = gepo.LossBatch(logprobs=logprobs, mask=torch.ones(8, 6), behaviour_logprobs=logprobs.detach().clone(),
                           rewards=torch.tensor([1.0, 0.0, 1.0, 0.0, *rewards]),
                           group_ids=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
    loss_fn = bounded(gepo.get_loss("gepo").fn, None, max_abs_reward, [])
    loss, _ = loss_fn(batch, gepo.make_loss_config("gepo"))
    loss.backward()
    return logprobs.grad.norm(dim=1)


def test_one_group_with_extreme_rewards_does_not_set_the_direction_of_a_gepo_update():
    """GEPO centres rewards per group without dividing by their spread, so a group rewarded ±1e6 weighed 2e6 times
    an honest group (rewards 0/1); ``rl.max_abs_reward`` (10) drops it, and a group at the bound weighs at most
    20 times."""
    extreme = [1e6, -1e6, 1e6, -1e6]
    before = _gepo_gradients(extreme, None)
    assert float(before[4:].norm() / before[:4].norm()) == pytest.approx(2e6, rel=0.01)
    after = _gepo_gradients(extreme, 10.0)
    assert float(after[4:].norm()) == 0.0
    torch.testing.assert_close(after[:4], _gepo_gradients([0.0] * 4, 10.0)[:4] * 2)  # (mean over 4 rows, not 8)
    at_bound = _gepo_gradients([10.0, -10.0, 10.0, -10.0], 10.0)
    assert float(at_bound[4:].norm() / at_bound[:4].norm()) == pytest.approx(20, rel=0.01)


def test_metrics_with_values_that_are_not_finite_stay_standard_json(tmp_path):
    """``metrics.jsonl`` and ``summary.json`` are read by strict JSON parsers: inf and NaN are written as null."""
    def strict(text):
        def refuse(name):
            raise ValueError(f"non-standard JSON constant {name}")
        return json.loads(text, parse_constant=refuse)

    logger = MetricsLogger(tmp_path, wandb_mode="disabled")
    logger.log(3, {"optim/grad_norm": math.inf, "is/weight_max": -math.inf, "loss/policy": math.nan, "ok": 0.25})
    logger.close()
    line = (tmp_path / "metrics.jsonl").read_text().strip()
    record = strict(line)
    assert record["step"] == 3 and record["ok"] == 0.25
    assert record["optim/grad_norm"] is None and record["is/weight_max"] is None and record["loss/policy"] is None
    assert read_metrics(tmp_path / "metrics.jsonl") == [record]
    summary = strict(json_text({"engines": {"torch": {"mismatch": math.nan}}, "history": [1.0, math.inf]}))
    assert summary == {"engines": {"torch": {"mismatch": None}}, "history": [1.0, None]}


@pytest.mark.parametrize("name, bad", [("max_log_ratio", 0), ("max_abs_reward", -1)])
def test_a_bound_is_positive_or_null(name, bad):
    with pytest.raises(ConfigError, match=f"rl.{name}"):
        load_config(None, [f"rl.{name}={bad}"])
    assert getattr(load_config(None, [f"rl.{name}=null"]).rl, name) is None
    assert getattr(load_config(None).rl, name) == 10.0


def test_a_step_without_signal_still_measures_the_learners_logprobs_of_its_rows(add3):
    """The training–inference mismatch is measured every step: a batch in which every group scored alike runs no
    update, and its first minibatch is forwarded (no gradient) for the learner's log-probs, which at the version
    that sampled it equal the worker's."""
    cfg, model, tok, version, datums = add3
    uniform = copy.deepcopy(datums)
    for d in uniform:
        d.reward = 1.0
    training = TrainingClient(copy.deepcopy(model), tok, seed=0)
    training.version = version
    fresh: dict = {}
    metrics = optimize_batch(training, uniform, cfg, total_updates=1, fresh_logprobs=fresh)
    assert metrics["optim/updates"] == 0 and metrics["optim/skip_reason"] == NO_SIGNAL
    assert sorted(fresh) == list(range(len(minibatches(uniform, cfg.rl.updates_per_batch)[0])))
    assert all(p.grad is None for p in training.model.parameters())
    for row, logprobs in fresh.items():
        assert len(logprobs) == len(uniform[row].behaviour_logprobs)
        assert max(abs(a - b) for a, b in zip(logprobs, uniform[row].behaviour_logprobs)) < 1e-4
