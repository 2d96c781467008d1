"""The hostile drill (scripts/hostile_fleet.py) against a real `heterorl learner` process, small: the learner
lives through every attack, stops cleanly on SIGTERM, trains only honest data (and the replaying peer's own
groups), tells each peer why it refused what it refused, and a worker arriving while the registry is full of the
flood's entries gets in."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ENV, REPO

ROUNDS, HELLOS, CONNECTIONS, MAX_WORKERS = 2, 200, 30, 16


@pytest.mark.slow
def test_a_real_learner_survives_the_hostile_drill(tmp_path):
    done = subprocess.run([sys.executable, "scripts/hostile_fleet.py", "--rounds", str(ROUNDS),
                           "--hellos", str(HELLOS), "--connections", str(CONNECTIONS), "--max-workers",
                           str(MAX_WORKERS), "--out", str(tmp_path)], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "every promise held" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "drill.json").read_text())
    learner = report["learner"]
    # still training after every drill, then stopped by SIGTERM: its step finished, a checkpoint to resume from
    assert learner["exit_code"] == 0 and learner["alive_after_drills"] and learner["late_worker_joined"]
    assert learner["stopped_by"] == "SIGTERM" and learner["steps"] >= 1
    state = json.loads((tmp_path / "run" / "checkpoints" / "learner_state.json").read_text())
    assert state["step"] == learner["steps"]
    assert set(learner["trained_from"]) <= {"honest", "late", "hostile-replay"}
    # every poisoned group refused whole, by the reason of its poisoned member
    poison = report["poison"]
    assert poison["accepted"] == 0 and poison["told"] == {
        "version_ahead": ROUNDS, "token_out_of_vocab": ROUNDS, "too_long": ROUNDS, "logprob_below_floor": ROUNDS,
        "group_too_large": 4 * ROUNDS, "group_rejected": 3 * 4 * ROUNDS}
    # groups never completed, started without permits: at most its probation permit's one held, the rest refused
    opened = report["open_groups"]
    assert opened["held"] <= 1 and opened["told"]["over_start_limit"] == opened["sent"] - opened["held"]
    # replayed ids are the peer's own; a forged sampler is refused
    assert report["replay"]["accepted"] == 4 * report["replay"]["groups"] and report["replay"]["told"] == {
        "forged_id": 4}
    # one connection's hellos each answered ready, each replacing the entry its previous hello made
    assert report["registry"]["one_connection_answers"] == {"ready": HELLOS}
    # every connection of the crowd was answered: ready while there was room (a place frees only by removing
    # an entry silent past its heartbeat timeout, counted), busy after
    answers, counts = report["registry"]["answers"], learner["transport"]
    assert sum(answers.values()) == CONNECTIONS and answers.get("bye (busy)", 0) >= 1
    assert answers.get("ready", 0) <= MAX_WORKERS + counts.get("workers_removed/made_room", 0)
    assert learner["duplicates"] == 0 and learner["dropped_trained"] == 0
    assert counts["rejected/over_start_limit"] >= opened["told"]["over_start_limit"]
    assert counts["workers_removed/replaced"] >= HELLOS - 1
