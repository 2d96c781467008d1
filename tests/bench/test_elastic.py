"""`heterorl bench elastic`'s scenario, short and driven by the learner's steps instead of the clock: six workers
join (four at once, two of them slow), one is killed, one frozen and thawed, two removed and one of them added back,
on loopback. Asserted: only what cannot depend on timing (the accounting, the joins, deaths, returns and departures
the learner saw, nothing trained twice, every worker's groups trained), never a rate, an idle time or a delay."""

import json

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.slow


def test_a_fleet_that_grows_shrinks_loses_a_host_and_freezes_one_loses_nothing_and_trains_nothing_twice(tmp_path):
    out = run_cli("bench", "elastic", "--steps-per-phase", "2", "--partition-s", "4", "--slow", "4",
                  "--phase-timeout-s", "240", "--out", str(tmp_path), timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    found = json.loads((tmp_path / "elastic.json").read_text())
    assert found["lost"] == 0 and found["trained_twice"] == 0
    rollouts = found["rollouts"]
    assert rollouts["trained"] == 4 * found["groups_trained"] > 0  # (groups of 4)
    assert sorted(found["staleness"]) == ["a1", "a2", "f1", "f2", "s1", "s2"]  # each had a group trained
    assert [j["first_trained_s"] is not None for j in found["joins"]] == [True] * 7  # f2's second life too
    events = found["learner_events"]
    assert events["joined"] == 6 and events["rejoined"] == 1  # f2 came back under its id
    assert events["dead"] >= 2 and events["back"] >= 1  # f1 killed, s1 frozen; s1 thawed
    assert events["left"] >= 2  # f2 and s2 said goodbye
    assert found["weights"]["f1"] == []  # killed: no goodbye, no tally
    assert len(found["weights"]["f2"]) == 2 and " 0 versions whole" not in found["weights"]["f2"][1]  # whole first
    assert found["windows"] and set(found["targets"]) >= {"nothing lost or trained twice"}
    assert found["targets"]["nothing lost or trained twice"]["verdict"] == "met"
    assert (tmp_path / "elastic.png").stat().st_size > 0
    assert "targets:" in out.stdout and "timeline (10 s windows" in out.stdout
