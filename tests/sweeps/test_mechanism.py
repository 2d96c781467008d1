"""The mechanism section of a sweep's report: both variances against the KL, per (loss, delay), and the length T
that fits Var(p/q) = e^(2·T·KL) − 1."""

import json
import math

import pytest

from heterorl.sweeps.mechanism import fitted_length, mechanism_points, mechanism_rows
from heterorl.sweeps.report import load_sweep, write_report

# (loss, delay) -> (KL of seed 0, KL of seed 1, applied weight variance); p/q's variance is e^(2·4·KL) − 1
GRID = {("gepo", "0"): (1e-13, 1e-13, 0.05), ("gepo", "16"): (0.02, 0.04, 0.06),
        ("grpo", "0"): (1e-13, 1e-13, 1e-13), ("grpo", "16"): (0.03, 0.05, 0.2)}


@pytest.fixture
def sweep_dir(tmp_path):
    root = tmp_path / "sweep"
    root.mkdir()
    (root / "sweep.json").write_text(json.dumps({
        "name": "mech", "losses": ["gepo", "grpo"], "delays": ["0", "16"], "seeds": [0, 1], "online_delay": "0",
        "seconds_per_step": None, "mode": "simulated"}))
    for (loss, delay), (kl0, kl1, applied) in GRID.items():
        for seed, kl in enumerate((kl0, kl1)):
            cell = root / "cells" / f"{loss}__d{delay}__s{seed}"
            cell.mkdir(parents=True)
            cell.joinpath("summary.json").write_text(json.dumps({
                "cell": cell.name, "task": "add3", "loss": loss, "delay": delay, "seed": seed, "status": "done",
                "base_success": 0.5, "best_success": 0.8, "final_success": 0.7, "steps": 4,
                "history": [{"step": 0, "eval/success": 0.5}, {"step": 4, "eval/success": 0.7}],
                "metric_means": {"kl/k3": kl, "is/weight_var": applied, "ratio/seq_var": math.expm1(8 * kl)}}))
    return root


def test_rows_average_the_seeds_and_the_fitted_length_is_the_generating_one(sweep_dir):
    sweep = load_sweep(sweep_dir)
    rows = {(r.loss, r.delay): r for r in mechanism_rows(sweep, "add3")}
    gepo = rows["gepo", "16"]
    assert gepo.n == 2 and gepo.kl == pytest.approx(0.03) and gepo.applied_var == pytest.approx(0.06)
    assert gepo.sequence_var == pytest.approx((math.expm1(0.16) + math.expm1(0.32)) / 2)
    assert gepo.ratio == pytest.approx(0.06 / gepo.sequence_var)
    assert rows["grpo", "0"].ratio is None  # on-policy: p/q did not vary
    assert fitted_length(mechanism_points(sweep, "add3")) == pytest.approx(4.0)  # on-policy runs left out


def test_the_report_has_the_mechanism_table_and_figure(sweep_dir):
    md = write_report(sweep_dir).read_text(encoding="utf-8")
    assert "### The mechanism: weight variance against the measured KL" in md
    assert "| gepo | 16 | 2 | 0.03 | 0.06 |" in md and "T = 4.0 tokens" in md
    assert "What the paper's argument predicts" in md and "(one drift level: nothing to compare)" in md
    png = sweep_dir / "report" / "mechanism_add3.png"
    assert png.read_bytes().startswith(b"\x89PNG") and "](mechanism_add3.png)" in md


def test_the_verdict_reads_whether_gepo_s_ratio_falls_with_the_kl():
    from heterorl.sweeps.mechanism import MechanismRow, _verdict

    online = MechanismRow("gepo", "0", 5, 1e-13, 0.05, 1e-12)
    falling = [online, MechanismRow("gepo", "4", 5, 0.01, 0.06, 0.2), MechanismRow("gepo", "64", 5, 0.08, 0.08, 2.0)]
    text = _verdict(falling)[0]
    assert "is 0.05)" in text and "0.3 → 0.04" in text and "as the argument predicts" in text
    assert "0.06" not in text and "2.0" not in text  # (the table says each row's numbers; the sentence, the ratio)
    rising = [online, MechanismRow("gepo", "4", 5, 0.01, 0.02, 0.2), MechanismRow("gepo", "64", 5, 0.08, 2.0, 2.0)]
    assert "do not follow" in _verdict(rising)[0]
    assert _verdict([online]) == []


def test_the_summary_across_sweeps_pools_the_tasks_paired_differences(sweep_dir, tmp_path):
    """Two sweeps (one task each): the claims of both, and GEPO − GRPO per task and pooled, each task the same
    weight, the interval from the per-task standard errors with Σ(n − 1) degrees of freedom."""
    from heterorl.sweeps.stats import Interval, t_quantile
    from heterorl.sweeps.summary import HAND_WRITTEN, pool, write_summary

    a = Interval(0.02, 0.02 - t_quantile(0.975, 4) * 0.01, 0.02 + t_quantile(0.975, 4) * 0.01, 5)  # se 0.01
    b = Interval(0.04, 0.04 - t_quantile(0.975, 4) * 0.02, 0.04 + t_quantile(0.975, 4) * 0.02, 5)  # se 0.02
    pooled = pool([a, b])
    half = t_quantile(0.975, 8) * math.sqrt(0.01 ** 2 + 0.02 ** 2) / 2
    assert pooled.mean == pytest.approx(0.03) and pooled.high - pooled.mean == pytest.approx(half)
    assert pool([Interval(0.1, 0.1, 0.1, 1)]) is None  # one seed: no spread, nothing to pool
    out = tmp_path / "SUMMARY.md"
    page = write_summary([sweep_dir, sweep_dir], out).read_text()
    assert "| GEPO degrades little from online to the largest staleness | mech / add3 |" in page
    # same scores for every loss and seed: a paired difference of exactly 0; the second sweep of the same task is
    # shown, not pooled again
    assert ("| grpo | 16 | mech / add3: +0.0 [+0.0, +0.0] (n=2); mech / add3: +0.0 [+0.0, +0.0] (n=2, not pooled: "
            "its task is pooled already) | +0.0 [+0.0, +0.0] |") in page
    # the reading written below the marker survives the page being written again
    out.write_text(page + f"\n{HAND_WRITTEN}\nGEPO wins here.\n")
    again = write_summary([sweep_dir], out).read_text()
    assert again.startswith("# Round-up") and again.endswith(f"{HAND_WRITTEN}\nGEPO wins here.\n")
    assert again.count(HAND_WRITTEN) == 1 and "not pooled" not in again


def test_the_report_command_writes_the_summary_and_refuses_two_folders_without_it(sweep_dir, tmp_path):
    from tests.conftest import run_cli

    out = run_cli("report", "--summary", str(tmp_path / "S.md"), str(sweep_dir))
    assert out.returncode == 0 and (tmp_path / "S.md").is_file(), out.stderr
    assert "(n=2)" in (tmp_path / "S.md").read_text()
    out = run_cli("report", "--summary", str(tmp_path / "S.md"), "--seeds", "0", str(sweep_dir))
    assert out.returncode == 0 and "(n=1)" in (tmp_path / "S.md").read_text() and "(n=2)" not in (
        tmp_path / "S.md").read_text(), out.stderr
    out = run_cli("report", str(sweep_dir), str(sweep_dir))
    assert out.returncode != 0 and "give --summary FILE" in out.stderr


def test_a_narrow_log_axis_gets_x_labels_that_do_not_run_into_each_other(tmp_path):
    """A log axis over less than a decade (a sweep whose KL spans 0.041-0.049) labels its minor ticks, which
    overlap; saved, the figure's labels are apart and still there."""
    from heterorl.sweeps.plots import pyplot, save, x_labels_overlap

    fig, ax = pyplot().subplots(figsize=(7, 5))
    ax.scatter([0.041, 0.043, 0.046, 0.049], [0.1, 0.5, 1.0, 2.0])
    ax.set(xscale="log", yscale="log")
    fig.tight_layout()
    assert x_labels_overlap(fig)  # (the case is real)
    save(fig, tmp_path / "narrow.png")
    assert not x_labels_overlap(fig)
    assert sum(bool(t.get_text()) for t in ax.get_xticklabels()) >= 2
