"""The peer-bounds drill (scripts/peer_bounds_drill.py) against a real `heterorl learner` process and an honest
`heterorl rollout` worker, small: during each attack on a bound the learner goes on training (two steps at
least, within a minute), training resumes after the attack, and the learner's memory stays within +300 MiB of
its level before the attacks.

How fast it trains under each attack, as a share of its quiet rate, is the drill's measure, run by hand on a quiet
machine (it exits 1 below 0.5 by default; docs/RELIABILITY.md has its table): the suite does not assert it. In a
suite that loads both cores with other tests, the 3 s windows took one step during the duplicates attack once,
0.14 of the quiet window's, where the same tree gave 0.7 quiet; a share asserted there follows the other tests'
load, not the bound (before the bounds, most attacks stopped training outright, which this test still catches:
no step in the 60 s after the first attack, none at all from the held members on)."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ENV, REPO

ATTACKS = ("open_groups", "silent_and_claiming", "flood", "held_members", "extreme_logprobs", "invented_names",
           "weights_readers", "large_messages", "duplicates", "connection_per_message", "short_frames",
           "repeated_hellos")


@pytest.mark.slow
def test_no_attack_on_a_bound_stalls_training_or_grows_the_learner(tmp_path):
    done = subprocess.run([sys.executable, "scripts/peer_bounds_drill.py", "--window-s", "3", "--min-share", "0",
                           "--min-steps", "2", "--give-up-s", "60", "--resume-s", "30", "--attacks", *ATTACKS,
                           "--out", str(tmp_path)], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and "every bound held" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "drill.json").read_text())
    assert report["learner_alive"] and set(report["attacks"]) == set(ATTACKS)
    for name, seen in report["attacks"].items():
        assert seen["steps"] >= 2 and seen["resume_s"] <= 30 and seen["rss_above_before_mib"] <= 300, (name, seen)
