"""A run's accounting: the tally of what it trained, the staleness histograms and the weights block."""

import json
import math
from collections import Counter

import numpy as np
import pytest

from heterorl.errors import HeteroRLError
from heterorl.runs import keep_metrics_until
from heterorl.runtime.accounting import (
    append_group_records,
    group_records,
    run_staleness,
    seconds_histogram,
    seconds_label,
    waste_line,
    weights_line,
    weights_summary,
)
from heterorl.runtime.buffer import Group
from tests.conftest import trajectory


def test_seconds_fall_in_doubling_bins_listed_in_order_with_zeros():
    assert [seconds_label(s) for s in (0.0, 0.3, 1.0, 3.9, 600.0)] == ["<0.25", "0.25-0.5", "1-2", "2-4", "512+"]
    hist = seconds_histogram({}, [0.1, 0.2, 5.0])
    assert list(hist)[:3] == ["<0.25", "0.25-0.5", "0.5-1"] and list(hist)[-1] == "512+"
    assert hist["<0.25"] == 2 and hist["4-8"] == 1 and sum(hist.values()) == 3
    assert seconds_histogram(hist, [5.5])["4-8"] == 2  # counts accumulate across steps


def test_run_staleness_lists_every_version_gap_up_to_the_largest():
    found = run_staleness({"0": 3, "2": 1}, {"1-2": 4}, 6.0, 4)
    assert found["staleness_hist"] == [3, 0, 1] and found["staleness_seconds_mean"] == 1.5
    assert found["staleness_seconds_hist"]["1-2"] == 4


def test_the_weights_block_and_line_say_what_the_deltas_saved():
    stats = Counter({"weights/versions": 5, "weights/version_bytes": 2_000_000, "weights/steps_encoded": 4,
                     "weights/step_bytes": 400_000, "weights/encode_s": 0.2, "weights/link_transfers": 6,
                     "weights/link_bytes": 4_400_000, "weights/link_skipped": 1})
    block = weights_summary(stats, "bfloat16", True)
    assert block["step_bytes_mean"] == 100_000 and block["bytes_ratio"] == 20.0 and block["encode_s_mean"] == 0.05
    line = weights_line(block)
    assert "5 versions of 2 MB in bfloat16" in line and "(20.0x smaller)" in line and "1 versions skipped" in line
    whole = weights_summary(Counter({"weights/versions": 2, "weights/version_bytes": 10}), "float32", False)
    assert math.isnan(whole["bytes_ratio"]) and "each sent whole" in weights_line(whole)


def test_the_weights_line_of_a_sharded_learner_says_the_bytes_are_rank_0s_share():
    stats = Counter({"weights/versions": 3, "weights/version_bytes": 1_000_000})
    assert "rank 0's slices: every one of 2 learner ranks" in weights_line(weights_summary(stats, "bfloat16", False, 2))
    assert "rank 0's slices" not in weights_line(weights_summary(stats, "bfloat16", False))


def test_a_tally_counts_each_batch_and_renders_the_summary_fields():
    from heterorl.runtime.accounting import RunTally
    from heterorl.runtime.buffer import Group
    from tests.conftest import trajectory

    def group(n: int, tokens: int) -> Group:
        return Group("g", [trajectory(trajectory_id=f"t{i}", completion_len=tokens) for i in range(n)], 0.0)

    tally = RunTally()
    tally.add_batch([group(2, 3), group(2, 5)], staleness=[0, 2], staleness_s=[0.1, 3.0])
    tally.add_batch([group(4, 1)], staleness=[2], staleness_s=[600.0])
    tally.idle_s, tally.elapsed_s = 1.0, 4.0
    fields = tally.summary_fields()
    assert (tally.groups_trained, tally.trajectories_trained, tally.tokens_trained) == (3, 8, 20)
    assert fields["staleness_mean"] == 4 / 3 and fields["staleness_max"] == 2 and fields["staleness_hist"] == [1, 0, 2]
    assert (fields["staleness_p50"], fields["staleness_p95"]) == (2.0, 2.0)
    assert fields["staleness_seconds_mean"] == 603.1 / 3
    assert fields["staleness_seconds_hist"]["<0.25"] == fields["staleness_seconds_hist"]["2-4"] == 1
    assert fields["staleness_seconds_hist"]["512+"] == 1
    assert (fields["tokens_per_s"], fields["samples_per_s"], fields["learner_idle_frac"]) == (5.0, 2.0, 0.25)


def test_a_learner_state_written_before_the_tally_had_its_own_key_is_read(tmp_path):
    """Checkpoints of earlier versions kept the tally's fields at the top level: they resume as they were."""
    import json

    from heterorl.runtime.checkpoints import LEARNER_STATE, _read_learner_state

    old = {"step": 4, "trained_ids": ["a"], "staleness_sum": 6.0, "staleness_max": 3, "groups_trained": 4,
           "staleness_counts": {"1": 2, "2": 2}, "idle_s": 1.5, "elapsed_s": 9.0, "steps_without_update": 1}
    (tmp_path / LEARNER_STATE).write_text(json.dumps(old))
    state = _read_learner_state(tmp_path / LEARNER_STATE)
    assert (state.step, state.steps_without_update, state.tally.groups_trained) == (4, 1, 4)
    assert (state.tally.staleness_sum, state.tally.staleness_counts, state.tally.elapsed_s) == (6.0, {"1": 2, "2": 2},
                                                                                               9.0)
    (tmp_path / LEARNER_STATE).write_text(json.dumps({**old, "tally": {"bogus": 1}}))
    with pytest.raises(HeteroRLError, match="a tally with no other keys than"):
        _read_learner_state(tmp_path / LEARNER_STATE)


def test_a_resumed_learners_waste_line_says_its_counts_are_of_its_own_leg():
    """The summary's steps and trajectories trained are the run's; the rollouts a resumed learner saw are its own
    leg's (288 of a 1,280-trajectory run), and the line says so instead of mixing the two unsaid."""
    leg = {"generated": 288, "trained": 288, "wasted_frac": 0.0, "discarded": {}, "left_over": 0}
    assert waste_line({**leg, "since_step": 31}).startswith("rollouts since the resume at step 31: 288 trajectories")
    assert waste_line({**leg, "since_step": None}).startswith("rollouts: 288 trajectories generated")


def test_the_summary_of_a_run_stopped_before_it_measured_anything_renders(tmp_path):
    """A learner stopped (Ctrl-C) before its first step, or before its first delta, writes NaN as null: the
    closing summary says "nan" there instead of failing on None."""
    from heterorl.runtime.accounting import summary_text

    nothing = None
    summary = {"base_success": 0.557, "final_success": 0.557, "best_success": 0.557, "mode": "async",
               "loss": "gepo", "steps": 0, "minutes": 0.1, "staleness_mean": nothing, "staleness_p50": nothing,
               "staleness_p95": nothing, "staleness_max": 0, "tokens_per_s": nothing, "learner_idle_frac": nothing,
               "worker_idle_frac": nothing, "staleness_seconds_mean": nothing, "samples_per_s": nothing,
               "stopped_by": "SIGINT", "rollouts": {"generated": 0, "trained": 0, "wasted_frac": 0.0,
                                                    "discarded": {}, "left_over": 0, "since_step": None},
               "weights": {"dtype": "float32", "deltas": True, "versions": 1, "version_bytes": 4215296,
                           "step_bytes_mean": nothing, "bytes_ratio": nothing, "link_transfers": 2,
                           "link_bytes": 8430592, "link_skipped": 0, "ranks": 1, "arrived": 0,
                           "arrival_s_mean": nothing, "arrival_s_max": nothing}}
    text = summary_text(summary, tmp_path)
    assert "staleness mean nan versions" in text and "weights: 1 versions of 4.22 MB in float32;" in text


def test_a_group_record_names_its_worker_versions_and_the_times_it_was_generated_arrived_and_trained(tmp_path):
    members = [trajectory(trajectory_id=f"w3-5-{i}", group_id="w3-5", sampler_id="w3", group_size=2,
                          policy_versions=np.array([4, 4 + i, 6], dtype=np.int32), generation_start=10.0 + i,
                          generation_end=12.0 + 3 * i, received_at=20.0 + i) for i in range(2)]
    other = [trajectory(group_id="w1-0", sampler_id="w1", group_size=1, version=7, received_at=21.0)]
    records = group_records([Group("w3-5", members, 0.0), Group("w1-0", other, 0.0)], [3, 0], step=9, version=7,
                            train_start=30.0, trained_at=31.5)
    assert records[0] == {"step": 9, "version": 7, "worker": "w3", "group_id": "w3-5", "oldest_version": 4,
                          "staleness": 3, "trajectories": 2, "generation_start": 10.0, "generation_end": 15.0,
                          "received_at": 21.0, "train_start": 30.0, "trained_at": 31.5}
    assert records[1]["worker"] == "w1" and records[1]["oldest_version"] == 7 and records[1]["staleness"] == 0
    log = tmp_path / "groups.jsonl"
    append_group_records(log, records[:1])
    append_group_records(log, [dict(records[1], step=10)])
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [9, 10]
    keep_metrics_until(log, 9)  # a learner resumed from step 9's checkpoint logs step 10 again
    assert [json.loads(line)["group_id"] for line in log.read_text().splitlines()] == ["w3-5"]
