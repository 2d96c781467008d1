import json

import pytest

from heterorl.sweeps.report import write_report
from heterorl.sweeps.tuning import choose_settings, loss_of, tuning_section

BASE = 0.5


def summary(label, evals, *, delay="lag16", status="done"):
    """A finished cell's summary.json as the sweep writes it: its label, its evals every 15 steps after the base."""
    history = [{"step": 0, "eval/success": BASE}] + [{"step": 15 * (i + 1), "eval/success": e}
                                                      for i, e in enumerate(evals)]
    return {"status": status, "task": "maze", "delay": delay, "seed": 0, "loss": label, "history": history}


LABELS = ["gepo", "gepo@clip_eps=0.1", "gepo@clip_eps=0.4",
          "grpo", "grpo@clip_eps=0.1", "grpo@clip_eps=0.4",
          "m2po", "m2po@m2_threshold=0.01", "m2po@m2_threshold=0.16",
          "decoupled_ppo", "decoupled_ppo@behaviour_weight_cap=5", "decoupled_ppo@behaviour_weight_cap=2"]
SUMMARIES = [
    # gepo: the best single eval (0.9) and the best final eval (0.7) are not the best last-3 mean (0.6 of 0.4)
    summary("gepo", [0.9, 0.5, 0.5, 0.5]),
    summary("gepo@clip_eps=0.1", [0.5, 0.6, 0.6, 0.6]),
    summary("gepo@clip_eps=0.4", [0.5, 0.3, 0.3, 0.7]),
    # grpo: a setting ties the default with the same evals in another order, its float mean one ulp higher: the
    # default is kept
    summary("grpo", [0.5, 0.3, 0.5, 0.6]),
    summary("grpo@clip_eps=0.1", [0.5, 0.6, 0.5, 0.3]),
    summary("grpo@clip_eps=0.4", [0.3, 0.3, 0.3, 0.3]),
    # m2po: the two other settings tie above the default: the first in sweep order
    summary("m2po", [0.2, 0.1, 0.1, 0.1]),
    summary("m2po@m2_threshold=0.01", [0.5, 0.4, 0.4, 0.4]),
    summary("m2po@m2_threshold=0.16", [0.5, 0.4, 0.4, 0.4]),
    # decoupled_ppo: the best-looking setting failed; one never started: chosen among those that finished
    summary("decoupled_ppo", [0.3, 0.3, 0.3, 0.3]),
    summary("decoupled_ppo@behaviour_weight_cap=5", [0.9, 0.9, 0.9, 0.9], status="failed"),
]


def test_each_loss_gets_its_best_last_evals_setting_and_a_tie_goes_to_the_default():
    choices = choose_settings(SUMMARIES, LABELS)
    assert {loss: c.chosen for loss, c in choices.items()} == {
        "gepo": "gepo@clip_eps=0.1", "grpo": "grpo", "m2po": "m2po@m2_threshold=0.01", "decoupled_ppo": "decoupled_ppo"}
    assert choices["gepo"].scores == pytest.approx({"gepo": 0.5, "gepo@clip_eps=0.1": 0.6,
                                                    "gepo@clip_eps=0.4": 13 / 30})
    assert choices["grpo"].scores["grpo"] < choices["grpo"].scores["grpo@clip_eps=0.1"]  # by float rounding alone
    assert choices["decoupled_ppo"].missing == ("decoupled_ppo@behaviour_weight_cap=5",
                                                "decoupled_ppo@behaviour_weight_cap=2")
    assert list(choices["decoupled_ppo"].scores) == ["decoupled_ppo"]


def test_the_score_is_averaged_over_a_settings_seeds_and_a_loss_with_nothing_finished_is_left_out():
    runs = [summary("sapo", [0.4, 0.4, 0.4]), {**summary("sapo", [0.8, 0.8, 0.8]), "seed": 1},
            summary("sapo@tau=2", [0.55, 0.55, 0.55]), summary("trm", [0.9, 0.9, 0.9], status="running")]
    choices = choose_settings(runs, ["sapo", "sapo@tau=2", "trm", "trm@max_divergence=10"])
    assert list(choices) == ["sapo"] and choices["sapo"].chosen == "sapo"  # 0.6 over its two seeds beats 0.55
    assert choices["sapo"].scores["sapo"] == pytest.approx(0.6)


def test_settings_are_chosen_at_one_staleness():
    runs = [summary("gepo", [0.5] * 3), summary("gepo@clip_eps=0.1", [0.6] * 3, delay="lag64")]
    with pytest.raises(ValueError, match="one \\(task, delay\\).*lag16.*lag64"):
        choose_settings(runs, ["gepo", "gepo@clip_eps=0.1"])


def test_a_label_names_its_loss_before_the_at_sign():
    assert [loss_of(label) for label in ("gepo", "gepo@clip_eps=0.1", "gspo@clip_scale=0.5")] == ["gepo"] * 2 + ["gspo"]


def test_the_report_of_a_tuning_sweep_says_the_setting_chosen_per_loss_and_others_do_not(tmp_path):
    assert tuning_section(SUMMARIES, ["gepo", "grpo"]) == []  # a delay sweep: no settings
    root = tmp_path / "tune"
    root.mkdir()
    (root / "sweep.json").write_text(json.dumps({"name": "tune", "mode": "simulated", "losses": LABELS,
                                                 "delays": ["lag16"], "seeds": [0], "online_delay": None}))
    for s in SUMMARIES:
        cell = root / "cells" / f"{s['loss']}__dlag16__s0"
        cell.mkdir(parents=True)
        done = {"base_success": BASE, "best_success": 0.9, "final_success": s["history"][-1]["eval/success"]}
        (cell / "summary.json").write_text(json.dumps({**s, **done}))
    text = write_report(root).read_text()
    section = text[text.index("## Tuning: the setting chosen per loss"):text.index("## Missing")]
    assert ("| gepo | `gepo@clip_eps=0.1` | gepo 50.0; **gepo@clip_eps=0.1 60.0**; gepo@clip_eps=0.4 43.3 | — |"
            in section)
    assert "| grpo | `grpo` |" in section
    assert "| decoupled_ppo | `decoupled_ppo` | **decoupled_ppo 30.0** | decoupled_ppo@behaviour_weight_cap=5, " \
           "decoupled_ppo@behaviour_weight_cap=2 |" in section
