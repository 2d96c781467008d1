"""scripts/test_times.py: the suite's slowest tests ranked, each marked as computing or waiting."""

import json
import subprocess
import sys

from tests.conftest import REPO


def test_tests_are_ranked_by_wall_time_and_marked_as_computing_or_waiting(tmp_path):
    times, before = tmp_path / "times.jsonl", tmp_path / "before.jsonl"
    rows = [{"test": "a", "wall_s": 10.0, "cpu_s": 1.0, "children_cpu_s": 0.5, "worker": "gw0"},
            {"test": "b", "wall_s": 20.0, "cpu_s": 4.0, "children_cpu_s": 8.0, "worker": "gw1"}]
    times.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before.write_text(json.dumps({**rows[1], "wall_s": 50.0}) + "\n")
    script = str(REPO / "scripts" / "test_times.py")
    out = subprocess.run([sys.executable, script, str(times), "--before", str(before)], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert out[0].startswith("2 tests: 30 s of test wall time") and "10 s in tests that mostly wait (33%)" in out[0]
    assert out[2].split() == ["20.0", "12.0", "cpu", "50.0", "b"]  # 12 CPU s in 20 s: computing
    assert out[3].split() == ["10.0", "1.5", "waits", "-", "a"]  # no earlier time
    times.write_text("not json\n")
    bad = subprocess.run([sys.executable, script, str(times)], capture_output=True, text=True)
    assert bad.returncode == 1 and "times.jsonl:1: not a line of HETERORL_TEST_TIMES" in bad.stderr
