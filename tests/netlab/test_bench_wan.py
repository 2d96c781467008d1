"""``heterorl bench wan``, small: the same run over the lab's links and on loopback with the delay model set
alike, every row measured in both, with their ratio; the lab's links lost frames as set."""

import json
import re

import pytest

from heterorl.netlab import missing
from tests.conftest import run_cli

WHY = missing()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")
ROWS = ("staleness mean (versions)", "staleness p95", "staleness mean (s)", "samples/s", "steps/s",
        "weights MB sent", "weights arrival mean (s)", "weights arrival max (s)")


@pytest.mark.slow
def test_bench_wan_puts_the_lab_and_the_model_side_by_side(tmp_path):
    out = run_cli("bench", "wan", "--steps", "4", "--workers", "1", "--loss", "0.02", "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for row in ROWS:  # (nan: not measured, e.g. no version's arrival reported before so short a run ended)
        found = re.search(rf"^  {re.escape(row)} +([\d.]+|nan) +([\d.]+|nan) +([\d.]+|nan)x$", out.stdout, re.M)
        assert found, (row, out.stdout)
        lab, model, ratio = map(float, found.groups())
        if model and model == model and lab == lab:
            assert ratio == pytest.approx(lab / model, abs=0.01)
    for row in ROWS[:6]:  # measured in both
        assert "nan" not in re.search(rf"^  {re.escape(row)} .*$", out.stdout, re.M).group(0), out.stdout
    for side in ("lab", "model"):  # both trained the same run to its end
        summary = json.loads((tmp_path / side / "run" / "summary.json").read_text())
        assert summary["steps"] == 4 and summary["rollouts"]["trained"] == 4 * 4 * 4, side
    frames = re.search(r"frames \[carried, dropped\] per link: (.*?); the wire", out.stdout)
    if "wire links" in out.stdout:  # the userspace wire counts what it dropped
        assert json.loads(frames.group(1).replace("'", '"'))[0]["down"][1] > 0, out.stdout
