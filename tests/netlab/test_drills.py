"""The fault drills (scripts/netlab_drills.py) on the network lab, small: partitions of one worker and of every
worker, healed; the learner keeps training while one worker is cut, both sides notice a cut within their
heartbeat bounds, the workers rejoin; lossy, reordering weights links and a bandwidth drop do not stop training;
the learner stops cleanly, nothing is trained twice and every rollout is accounted for. Then the learner is
resumed and its host reboots behind lossy links: it resumes on its address, both workers join it, and no
trajectory is trained twice across its three lives."""

import json
import re
import subprocess
import sys

import pytest

from heterorl.netlab import missing
from tests.conftest import ENV, REPO

WHY = missing()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")


@pytest.mark.slow
def test_partitions_are_noticed_healed_and_lose_nothing(tmp_path):
    done = subprocess.run([sys.executable, "scripts/netlab_drills.py", "--partition-s", "6", "--phase-s", "4",
                           "--reboot-down-s", "3",
                           "--out", str(tmp_path)], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "every promise held" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "drills.json").read_text())
    assert report["partition_one"]["steps_during_cut"] > 0  # the learner never blocked on the cut link
    for drill in ("partition_one", "partition_all"):
        for times in report[drill]["workers"].values():
            assert times["learner_noticed_s"] is not None and times["worker_noticed_s"] is not None
    run = report["run"]
    # none lost: the workers' heartbeats count what they generated, so the learner may hold a few more when it stops
    assert run["stopped_by"] == "SIGTERM" and run["duplicates"] == 0 and run["unaccounted"] <= 0
    assert report["learner_exit"] == 0 and report["w1_exit"] == 0 and report["w2_exit"] == 0
    # through 5 % loss and reordering on the weights links and a drop to 10 Mbit/s the learner kept stepping
    assert report["lossy_weights"]["during"]["steps"] > 0 and report["bandwidth_drop"]["during"]["steps"] > 0
    reboot = report["learner_reboot"]
    assert report["rebooted_exit"] == 0 and reboot["stopped_by"] == "SIGTERM"
    assert set(reboot["joined_after_start_s"]) == {"w1", "w2"} and reboot["trained_twice"] == 0
    assert reboot["steps"] >= reboot["resumed_from_step"] + 3
    # every version a worker took arrived exact, through the lossy and reordering links (TCP's checksums and ours)
    for k in (1, 2):
        assert re.search(r"\b0 checksum failures", report[f"w{k}_tally"]), report[f"w{k}_tally"]
