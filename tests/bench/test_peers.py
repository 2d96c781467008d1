"""`heterorl bench peers`: the TRL config built from a heterorl config matches it option by option, a missing TRL
and bad options give clear messages, and one tiny TRL step runs end to end (times and accuracy sane, not timed)."""

import math
import subprocess
import sys
import time

import pytest

from heterorl.bench import peers
from heterorl.bench.peers import DescendantPeaks, Setting, answer_prefix, heterorl_config, main, summarize


def _setting(**changes) -> Setting:
    values = {"model": "add3", "steps": 5, "prompts": 3, "group_size": 6, "max_tokens": 7, "threads": 1,
              "eval_size": 16, "seed": 4}
    return Setting(**{**values, **changes})


def test_answer_prefix_is_the_exact_reward_with_partial_credit_below_it():
    assert answer_prefix("", "579", "579") == 1.0
    assert answer_prefix("", "57 apples", "579") == pytest.approx(0.5 * 2 / 3)
    assert answer_prefix("", "5790", "579") == 0.5  # every digit, then more: not the answer
    assert answer_prefix("", "The sum", "579") == 0.0


def test_summarize_leaves_out_the_first_step():
    out = summarize([9.0, 2.0, 4.0], [5.0, 1.0, 1.0], [100.0, 30.0, 60.0])
    assert out == {"step_s": 3.0, "generation_s": 1.0, "training_s": 2.0, "tokens_per_s": 15.0, "steps_measured": 2}
    assert summarize([2.0], [0.5], [10.0])["training_s"] == 1.5  # one step: that one


def test_heterorl_config_applies_the_setting(tmp_path):
    cfg = heterorl_config(_setting(), tmp_path / "run")
    assert (cfg.rl.base, cfg.seed, cfg.rl.steps, cfg.rl.prompts_per_step) == ("add3-sft-base", 4, 5, 3)
    assert (cfg.rollout.group_size, cfg.rollout.max_tokens, cfg.task.options["eval_size"]) == (6, 7, 16)
    assert (cfg.loss.name, cfg.rl.updates_per_batch, cfg.optim.warmup_steps, cfg.optim.schedule) == \
        ("grpo", 1, 0, "constant")
    assert cfg.task.reward_fn is None
    assert heterorl_config(_setting(model="smollm2"), tmp_path / "s").task.reward_fn == \
        "heterorl.bench.peers:answer_prefix"


def test_trl_config_matches_the_heterorl_config(tmp_path):
    pytest.importorskip("trl")
    cfg = heterorl_config(_setting(activation_checkpointing=True), tmp_path / "run")
    args = peers.trl_config(cfg, tmp_path / "trl")
    assert args.num_generations == 6 and args.per_device_train_batch_size == 18  # 3 prompts x 6 per step
    assert (args.generation_batch_size, args.steps_per_generation, args.gradient_accumulation_steps,
            args.num_iterations) == (18, 1, 1, 1)  # one optimizer step per generation batch, used once
    assert (args.max_steps, args.max_completion_length, args.seed) == (5, 7, 4)
    assert (args.temperature, args.top_p, args.top_k) == (cfg.rollout.temperature, cfg.rollout.top_p, 0)
    assert (args.loss_type, args.beta, args.scale_rewards, args.epsilon, args.epsilon_high) == \
        ("grpo", 0.0, "group", 0.2, 0.2)
    assert (args.learning_rate, args.lr_scheduler_type.value, args.warmup_steps) == (1e-4, "constant", 0)
    assert (args.adam_beta1, args.adam_beta2, args.adam_epsilon, args.weight_decay, args.max_grad_norm) == \
        (0.9, 0.999, 1e-8, 0.0, 1.0)
    assert (args.bf16, args.fp16, args.gradient_checkpointing, args.shuffle_dataset) == (False, False, True, False)


def test_trl_config_refuses_what_it_cannot_match(tmp_path):
    pytest.importorskip("trl")
    for overrides, words in ((("loss.name=gepo",), "GRPO"), (("optim.warmup_steps=3",), "warm-up"),
                             (("rl.updates_per_batch=2",), "one optimizer step")):
        with pytest.raises(ValueError, match=words):
            peers.trl_config(heterorl_config(_setting(), tmp_path / "run", overrides), tmp_path / "trl")


def test_without_trl_it_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "trl", None)  # (import trl then raises ImportError)
    assert main(["--models", "add3"]) == 2
    assert "make peers" in capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (["--steps", "2"], "argument --steps: '2': must be >= 3"),
    (["--group-size", "1"], "must be >= 2"),
    (["--prompts", "x"], "'x' is not an integer"),
    (["--systems", "rl,vllm"], "give a comma-separated list of rl, async1, async2, trl"),
    (["--models", "gpt2"], "give a comma-separated list of add3, smollm2"),
])
def test_bad_options_are_argparse_errors(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert words in capsys.readouterr().err


def test_descendant_peaks_reads_a_child_processes_peak():
    code = "import time; block = bytearray(200 * 2**20); block[::4096] = b'x' * len(block[::4096]); time.sleep(1.0)"
    with DescendantPeaks(every_s=0.1) as seen:
        child = subprocess.Popen([sys.executable, "-c", code])
        time.sleep(0.8)
        child.wait()
    assert seen.peaks_kb.get(child.pid, 0) / 1024 >= 200


def test_one_trl_step_runs_end_to_end(tmp_path):
    pytest.importorskip("trl")
    setting = _setting(steps=1, prompts=2, group_size=2, max_tokens=6)
    out = peers.run_trl(heterorl_config(setting, tmp_path / "run"))
    assert out["updates"] == 1 and out["steps_measured"] == 1
    for key in ("step_s", "generation_s", "training_s", "tokens_per_s", "peak_rss_mb"):
        assert math.isfinite(out[key]) and out[key] > 0, (key, out)
    assert 0.0 <= out["accuracy"] <= 1.0


def test_the_sync_loop_runs_with_its_sampling_timed(tmp_path):
    out = peers.run_sync(heterorl_config(_setting(steps=2, prompts=2, group_size=4, max_tokens=6), tmp_path / "run"))
    assert out["steps_measured"] == 1 and out["updates"] <= 2
    assert 0 < out["generation_s"] < out["step_s"] and out["tokens_per_s"] > 0 and 0.0 <= out["accuracy"] <= 1.0


def test_the_async_runtime_runs_with_all_its_processes_measured(tmp_path):
    setting = _setting(steps=3, prompts=2, group_size=4, max_tokens=6)
    cfg = heterorl_config(setting, tmp_path / "run", ("runtime.mode=async", "runtime.workers=1",
                                                       "logging.save_policy=true"))
    out = peers.run_async(cfg)
    assert out["steps_measured"] == 1 and out["tokens_per_s"] > 0 and 0.0 <= out["accuracy"] <= 1.0
    assert out["processes"] >= 2  # a learner and a worker at least, each a process of its own
    assert out["peak_rss_mb"] > peers._peak_rss_mb()
