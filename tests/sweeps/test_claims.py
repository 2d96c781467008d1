"""The paper's claims checked on a sweep: each verdict from paired 95 % intervals, on sweeps built by hand."""

import json
import re
from pathlib import Path

import pytest

from heterorl.sweeps.claims import (
    NOT_DECIDED,
    NOT_REPRODUCED,
    REPRODUCED,
    best_to_last_gap,
    change,
    paper_claims,
)
from heterorl.sweeps.report import load_sweep, write_report

COMMITTED = Path(__file__).parents[2] / "experiments" / "results"  # the sweeps whose reports are committed

STALENESS = {"lag0": 0.0, "lag4": 4.0, "lag32": 32.0}
# (loss, delay) -> the last-evals score of seeds 0, 1, 2
SCORES = {
    ("gepo", "lag0"): (0.80, 0.82, 0.81), ("gepo", "lag4"): (0.80, 0.81, 0.80), ("gepo", "lag32"): (0.79, 0.80, 0.80),
    ("grpo", "lag0"): (0.80, 0.82, 0.81), ("grpo", "lag4"): (0.79, 0.82, 0.80), ("grpo", "lag32"): (0.70, 0.71, 0.72),
    ("gspo", "lag0"): (0.80, 0.81, 0.81), ("gspo", "lag4"): (0.80, 0.80, 0.80), ("gspo", "lag32"): (0.75, 0.76, 0.74),
}
GAPS = {"gspo": (0.10, 0.12, 0.11)}  # best eval minus last score at every delay; 0.01, 0.02, 0.01 otherwise
SEQ_VAR = {"lag0": (0.0, 0.0, 0.0), "lag4": (0.10, 0.12, 0.11), "lag32": (1.0, 1.2, 1.1)}  # ratio/seq_var


def _cell(root, loss, delay, seed, score, gap, means):
    # evals after the base: best = score + gap, then two that bring the last-3 mean back to the score
    evals = [score + gap, score - gap / 2, score - gap / 2]
    history = [{"step": 0, "eval/success": 0.5}] + [{"step": 10 * (i + 1), "eval/success": e}
                                                    for i, e in enumerate(evals)]
    folder = root / "cells" / f"{loss}__d{delay}__s{seed}"
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({
        "cell": folder.name, "task": "arithmetic", "loss": loss, "delay": delay, "seed": seed, "status": "done",
        "base_success": 0.5, "final_success": evals[-1], "best_success": max(evals), "steps": 30,
        "staleness_mean": STALENESS[delay], "staleness_max": STALENESS[delay], "history": history,
        "metric_means": means}))  # no metrics.jsonl: the claims read what the summary kept


def _sweep(tmp_path, scores=SCORES, losses=("gepo", "grpo", "gspo")):
    root = tmp_path / "sweep"
    root.mkdir()
    (root / "sweep.json").write_text(json.dumps({
        "name": "claims", "mode": "simulated", "losses": list(losses), "delays": list(STALENESS),
        "seeds": [0, 1, 2], "online_delay": "lag0", "seconds_per_step": 28.125}))
    for (loss, delay), values in scores.items():
        if loss not in losses:
            continue
        for seed, score in enumerate(values):
            gap = GAPS.get(loss, (0.01, 0.02, 0.01))[seed]
            means = {"ratio/seq_var": SEQ_VAR[delay][seed], "is/weight_var": SEQ_VAR[delay][seed] / 10}
            _cell(root, loss, delay, seed, score, gap, means)
    return root


def test_a_sweep_that_agrees_with_the_paper_reproduces_every_claim(tmp_path):
    claims = paper_claims(load_sweep(_sweep(tmp_path)), "arithmetic")
    assert [c.verdict for c in claims] == [REPRODUCED] * 5, [c.sentence() for c in claims]
    # GEPO's drops lag0 -> lag32 are 0.01, 0.02, 0.01: mean 0.0133, t(0.975, 2) = 4.303, s = 0.00577,
    # half width 4.303 * 0.00577 / sqrt(3) = 0.0143 -> [-0.001, 0.028], inside "little" (<= 0.03)
    assert "lag0 minus lag32 (staleness 32.0): 0.013 [-0.001, 0.028] (its fall;" in claims[0].evidence
    assert "lag4 (staleness 4.0)" in claims[2].evidence  # the smallest stale setting, by measured staleness


def test_a_sweep_without_a_small_staleness_has_not_tested_the_third_claim(tmp_path, monkeypatch):
    """Staleness 4 is "small" only while it is at most SMALL_STALENESS: above it the claim is not tested, even
    where GEPO and GRPO are within a point of each other."""
    monkeypatch.setitem(STALENESS, "lag4", 12.0)  # the least stale setting measured 12 versions
    claims = paper_claims(load_sweep(_sweep(tmp_path)), "arithmetic")
    assert claims[2].verdict == NOT_DECIDED
    assert claims[2].evidence.startswith("not tested: the least stale setting, lag4 (staleness 12.0), is above "
                                         "the 8 versions taken as small; GEPO minus GRPO there: ")
    assert [c.verdict for c in claims[:2] + claims[3:]] == [REPRODUCED] * 4


def test_verdicts_follow_the_intervals(tmp_path):
    # GRPO falls less than GEPO (0.00-0.01 vs 0.09-0.11): claim 2 is reversed, claim 1 fails its margin
    flipped = {**SCORES, ("gepo", "lag32"): (0.70, 0.71, 0.72), ("grpo", "lag32"): (0.80, 0.81, 0.81)}
    claims = paper_claims(load_sweep(_sweep(tmp_path, flipped)), "arithmetic")
    assert (claims[0].verdict, claims[1].verdict) == (NOT_REPRODUCED, NOT_REPRODUCED)
    # at lag4 GEPO and GRPO differ by 0.10 on one seed only: the interval spans the margin, nothing is decided
    noisy = {**SCORES, ("grpo", "lag4"): (0.80, 0.81, 0.70)}
    (tmp_path / "noisy").mkdir()
    assert paper_claims(load_sweep(_sweep(tmp_path / "noisy", noisy)), "arithmetic")[2].verdict == NOT_DECIDED


def test_a_sweep_without_a_loss_says_what_it_lacks(tmp_path):
    claims = paper_claims(load_sweep(_sweep(tmp_path, losses=("gepo", "grpo"))), "arithmetic")
    assert claims[3].verdict == NOT_DECIDED and claims[3].evidence == "the sweep lacks gspo"
    (tmp_path / "no-grpo").mkdir()
    claims = paper_claims(load_sweep(_sweep(tmp_path / "no-grpo", losses=("gepo",))), "arithmetic")
    assert {c.verdict for c in claims} == {NOT_DECIDED} and claims[0].evidence == "the sweep lacks grpo"


def test_the_report_says_each_claim_in_a_sentence(tmp_path):
    root = _sweep(tmp_path)
    summary = write_report(root).read_text()
    assert "### The paper's claims" in summary
    assert "- GRPO degrades more than GEPO: **reproduced** — GRPO's fall minus GEPO's" in summary
    assert "the paper's claims:" in (root / "report" / "table.txt").read_text()


def test_best_to_last_gap():
    history = [{"step": 0, "eval/success": 0.9}, {"step": 1, "eval/success": 0.5},
               {"step": 2, "eval/success": 0.7}, {"step": 3, "eval/success": 0.4}, {"step": 4, "eval/success": 0.4}]
    assert best_to_last_gap(history) == pytest.approx(0.7 - 0.5)  # the base is not the run's best


def test_a_sweep_of_one_stale_setting_decides_late_collapse_only(tmp_path):
    """Long runs at one lag (no online setting): GSPO's best-to-last gap against GEPO's is still checked."""
    root = tmp_path / "sweep"
    root.mkdir()
    (root / "sweep.json").write_text(json.dumps({
        "name": "long", "mode": "simulated", "losses": ["gepo", "gspo", "grpo"], "delays": ["lag32"],
        "seeds": [0, 1, 2], "online_delay": None, "seconds_per_step": 28.125}))
    for loss in ("gepo", "gspo", "grpo"):
        for seed, score in enumerate(SCORES[loss, "lag32"]):
            _cell(root, loss, "lag32", seed, score, GAPS.get(loss, (0.01, 0.02, 0.01))[seed], {})
    claims = paper_claims(load_sweep(root), "arithmetic")
    assert [c.verdict for c in claims[:3]] == [NOT_DECIDED] * 3
    assert claims[0].evidence == "the sweep has no online setting"
    assert claims[3].verdict == REPRODUCED and "GSPO's best-to-last gap minus GEPO's at lag32" in claims[3].evidence
    assert claims[4].verdict == NOT_DECIDED and "one stale setting" in claims[4].evidence
    assert "GSPO's best-to-last gap is larger than GEPO's" in write_report(root).read_text()


def test_a_change_is_said_with_its_sign_once():
    assert (change(0.0123), change(-0.008), change(0.0001)) == ("rose by 0.012", "fell by 0.008", "did not change")


def _reads_cleanly(claims) -> None:
    """No sign said twice ("fell by -0.008", "+-"), no word repeated back to back, no clause said twice."""
    for claim in claims:
        text = claim.sentence()
        assert not re.search(r"(rose|fell|by) -|\+-|-\+|--\d", text), text
        assert not re.search(r"\b(\w+) \1\b", text), text
        clauses = [c.strip() for c in re.split(r"[;:—]", text) if c.strip()]
        assert len(clauses) == len(set(clauses)), text


def test_a_sweep_where_gepo_rose_when_stale_reads_cleanly(tmp_path):
    """GEPO better stale than online, GRPO too: the falls are negative, and said without a double sign."""
    rose = {**SCORES, ("gepo", "lag32"): (0.83, 0.85, 0.84), ("grpo", "lag32"): (0.82, 0.84, 0.82)}
    claims = paper_claims(load_sweep(_sweep(tmp_path, rose)), "arithmetic")
    _reads_cleanly(claims)
    assert "GRPO rose by 0.017, GEPO rose by 0.030" in claims[1].evidence, claims[1].evidence


@pytest.mark.parametrize("sweep_dir", sorted(COMMITTED.glob("*/sweep.json")), ids=lambda p: p.parent.name)
def test_the_claims_of_every_committed_sweep_read_cleanly(sweep_dir):
    sweep = load_sweep(sweep_dir.parent)
    for task in sweep.tasks:
        _reads_cleanly(paper_claims(sweep, task))
