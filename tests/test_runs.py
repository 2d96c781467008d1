"""heterorl/runs.py: what a run writes and how it is read back."""

from heterorl.runs import read_metrics


def test_a_live_runs_metrics_are_read_without_the_line_still_being_written(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 0.5}\n\n{"step": 2, "loss": 0.4}\n{"step": 3, "lo')
    assert read_metrics(path) == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4}]
