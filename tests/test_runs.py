"""heterorl/runs.py: what a run writes and how it is read back."""

import pytest

from heterorl.errors import ConfigError, TaskError
from heterorl.runs import read_metrics
from heterorl.tasks.base import Problem


def test_a_live_runs_metrics_are_read_without_the_line_still_being_written(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 0.5}\n\n{"step": 2, "loss": 0.4}\n{"step": 3, "lo')
    assert read_metrics(path) == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4}]


class _NoDemonstrations:
    """A task whose environment scores and which has no expert (as verifiers' and the cookbook's envs)."""

    name = "no_demos"

    def eval_problems(self):
        return [Problem("p0", "abc", "")]

    def demonstration(self, problem):
        raise TaskError("no_demos has no demonstrations for SFT")


def test_a_base_is_checked_on_the_prompts_of_a_task_without_demonstrations():
    from heterorl.config import load_config
    from heterorl.policies.tiny import build_char_tokenizer
    from heterorl.runs import check_base_reads_task

    cfg = load_config(None, ["task.name=maze"])
    check_base_reads_task(cfg, _NoDemonstrations(), build_char_tokenizer("abc"), "mine")  # reads "abc": no error
    with pytest.raises(ConfigError, match="cannot represent 'abc'.*rl.base=smollm2"):
        check_base_reads_task(cfg, _NoDemonstrations(), build_char_tokenizer("xyz"), "mine")
