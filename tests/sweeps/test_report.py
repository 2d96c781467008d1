import json
import math

import pytest

from heterorl.errors import HeteroRLError
from heterorl.sweeps.report import (
    compare_table,
    confidence_rows,
    load_sweep,
    log_report_to_wandb,
    summary_rows,
    write_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BASE = 0.4

# (loss, delay) -> [(best, last) of seed 0, seed 1]
GRID = {
    ("gepo", "0"): [(0.8, 0.7), (0.9, 0.9)],
    ("gepo", "8"): [(0.7, 0.6), (0.9, 0.6)],
    ("gepo", "16"): [(0.5, 0.3), (0.5, 0.5)],
    ("grpo", "0"): [(0.5, 0.5), (0.6, 0.5)],
    ("grpo", "8"): [(0.5, 0.4), (0.3, 0.2)],
    ("grpo", "16"): [(0.2, 0.1), None],  # seed 1 still running
}
NAN_KL_CELL = ("grpo", "8", 0)


def _write_cell(root, loss, delay, seed, best, last, *, kl=(0.01, 0.03)):
    cell = root / "cells" / f"{loss}__d{delay}__s{seed}"
    cell.mkdir(parents=True)
    summary = {"cell": cell.name, "task": "maze", "loss": loss, "delay": delay, "seed": seed, "mode": "simulated",
               "status": "done", "base_success": BASE, "final_success": last, "best_success": best, "steps": 4,
               "minutes": 0.1, "staleness_mean": int(delay) / 2 + seed, "staleness_max": int(delay),
               "staleness_p50": int(delay) / 2 + seed, "staleness_p95": 0.9 * int(delay),
               "history": [{"step": 0, "eval/success": BASE}, {"step": 2, "eval/success": best},
                           {"step": 4, "eval/success": last}]}
    is_var = 0.1 * (seed + 1)
    records = [{"step": 0, "eval/success": BASE},
               {"step": 1, "ratio/seq_var": is_var, "kl/k1": 0.5, "kl/k3": kl[0]},
               {"step": 2, "eval/success": best, "ratio/seq_var": is_var + 0.2, "kl/k3": kl[1]},
               {"step": 3, "rollout/reward_mean": 0.5},
               {"step": 4, "eval/success": last, **({"kl/k3": kl[2]} if len(kl) > 2 else {})}]
    (cell / "summary.json").write_text(json.dumps(summary))
    (cell / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")


def _write_spec(root, delays, seeds, losses=("gepo", "grpo")):
    root.mkdir(parents=True, exist_ok=True)
    (root / "sweep.json").write_text(json.dumps({
        "name": "maze-test", "losses": list(losses), "delays": list(delays), "seeds": list(seeds),
        "online_delay": "0", "seconds_per_step": None, "mode": "simulated"}))


@pytest.fixture
def sweep_dir(tmp_path):
    root = tmp_path / "sweep"
    _write_spec(root, ["0", "8", "16"], [0, 1])
    for (loss, delay), seeds in GRID.items():
        for seed, cell in enumerate(seeds):
            if cell is not None:
                kl = (0.01, math.nan, 0.05) if (loss, delay, seed) == NAN_KL_CELL else (0.01, 0.03)
                _write_cell(root, loss, delay, seed, *cell, kl=kl)
    running = root / "cells" / "grpo__d16__s1"
    running.mkdir()
    (running / "summary.json").write_text(json.dumps({"status": "running", "loss": "grpo", "delay": "16", "seed": 1}))
    return root


def test_summary_rows_are_the_seed_statistics(sweep_dir):
    sweep = load_sweep(sweep_dir)
    rows = {(r.loss, r.delay): r for r in summary_rows(sweep)["maze"]}
    assert list(rows) == list(GRID)

    online = rows["gepo", "0"]
    assert (online.n_seeds, online.degradation_pct) == (2, 0.0)
    assert online.best_mean == pytest.approx(0.85) and online.best_std == pytest.approx(0.05)
    assert online.last_mean == pytest.approx(0.8) and online.last_std == pytest.approx(0.1)  # ddof=0
    assert online.gap_mean == pytest.approx(0.05)
    assert online.base_mean == pytest.approx(BASE)

    d8 = rows["gepo", "8"]
    assert d8.last_mean == pytest.approx(0.6) and d8.last_std == pytest.approx(0.0)
    # degradation on the claims' measure, the mean of the last 3 evals (here best and last): online 0.825, 0.7
    assert d8.degradation_pct == pytest.approx(100 * (0.825 - 0.7) / 0.825)
    assert d8.gap_mean == pytest.approx(0.2)
    assert d8.staleness_mean == pytest.approx(4.5)
    assert d8.seq_ratio_var == pytest.approx(0.25)  # seeds' step means 0.2 and 0.3
    assert d8.kl_k3 == pytest.approx(0.02)
    assert rows["gepo", "16"].degradation_pct == pytest.approx(100 * (0.825 - 0.45) / 0.825)
    assert rows["gepo", "16"].gap_mean == pytest.approx(0.1)

    nan_kl = rows["grpo", "8"]
    assert nan_kl.kl_k3 == pytest.approx((0.03 + 0.02) / 2)  # NaN step skipped: seed 0 mean (0.01 + 0.05) / 2
    assert nan_kl.degradation_pct == pytest.approx(100 * (0.525 - 0.35) / 0.525)

    one_seed = rows["grpo", "16"]
    assert (one_seed.n_seeds, one_seed.last_std) == (1, 0.0)
    assert one_seed.degradation_pct == pytest.approx(100 * (0.525 - 0.15) / 0.525)
    assert sweep.missing() == [("grpo__d16__s1", "running")]


def test_write_report_writes_tables_plots_and_missing_cells(sweep_dir):
    summary = write_report(sweep_dir)
    out = sweep_dir / "report"
    assert summary == out / "summary.md"

    pngs = {p.name for p in out.glob("*.png")}
    assert pngs == {"success_vs_step_maze_0.png", "success_vs_step_maze_8.png", "success_vs_step_maze_16.png",
                    "final_vs_delay_maze.png", "drift_vs_delay_maze.png"}
    for name in pngs:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000

    md = summary.read_text(encoding="utf-8")
    assert md.startswith("# Delay sweep `maze-test` (simulated)")
    assert ("| gepo | 8 | 2 | 0.800 ± 0.100 | 0.600 ± 0.000 | +15.2% | 0.200 | 4.50 / 4.5 / 7.2 / 8 | 0.25 | 0.02 |"
            in md)
    assert "- `grpo__d16__s1`: running" in md
    assert "ddof=0" in md
    assert "degradation: (online - stale) / online in percent of the mean success over the last 3 evals" in md
    for name in pngs:
        assert f"]({name})" in md

    table = (out / "table.txt").read_text(encoding="utf-8")
    assert "0.850 ± 0.050  0.800 ± 0.100  +0.0%" in table
    assert "grpo__d16__s1: running" in table and "ddof=0" in table

    exported = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    finished = sum(1 for seeds in GRID.values() for cell in seeds if cell is not None)
    assert len(exported) == 5 * finished  # every logged step of every finished cell, nothing of the running one
    first = next(r for r in exported if r["cell"] == "gepo__d8__s1" and r["step"] == 1)
    assert first == {"cell": "gepo__d8__s1", "task": "maze", "loss": "gepo", "delay": "8", "seed": 1, "step": 1,
                     "ratio/seq_var": 0.2, "kl/k1": 0.5, "kl/k3": 0.01}


def test_one_delay_sweep_skips_vs_delay_plots_and_lists_absent_cells(tmp_path):
    root = tmp_path / "compare"
    _write_spec(root, ["16"], [0, 1, 2])
    _write_cell(root, "gepo", "16", 0, 0.6, 0.5)
    _write_cell(root, "grpo", "16", 0, 0.5, 0.3)
    (root / "cells" / "gepo__d16__s1").mkdir()

    write_report(root, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").glob("*.png")) == ["success_vs_step_maze_16.png"]

    sweep = load_sweep(root)
    assert sweep.missing() == [("gepo__d16__s1", "no summary.json"), ("gepo__d16__s2", "not started"),
                               ("grpo__d16__s1", "not started"), ("grpo__d16__s2", "not started")]
    assert [r.degradation_pct for r in summary_rows(sweep)["maze"]] == [None, None]  # no online cell
    seed0 = load_sweep(root, seeds=[0])  # the seeds a running sweep has finished everywhere
    assert seed0.seeds == [0] and seed0.missing() == [] and len(seed0.cells) == 2
    with pytest.raises(HeteroRLError, match=r"seeds \[5\] are not in the sweep"):
        load_sweep(root, seeds=[5])
    lines = compare_table(sweep).splitlines()
    assert lines[0] == "maze, delay 16:"
    assert lines[3].split() == ["gepo", "1", "0.400", "0.600", "±", "0.000", "0.500", "±", "0.000", "8.00", "/",
                                "8", "/", "14.4", "/", "16", "0.2", "0.02"]
    assert lines[4].split()[:7] == ["grpo", "1", "0.400", "0.500", "±", "0.000", "0.300"]


@pytest.mark.parametrize("content", [None, "{not json", json.dumps({"name": "x", "losses": ["gepo"]})])
def test_bad_sweep_spec_raises_naming_the_path(tmp_path, content):
    if content is not None:
        (tmp_path / "sweep.json").write_text(content)
    with pytest.raises(HeteroRLError, match=str(tmp_path / "sweep.json")):
        load_sweep(tmp_path)


def test_wandb_report_is_an_offline_run_in_the_sweep_group(sweep_dir):
    log_report_to_wandb(sweep_dir, project="heterorl-test", mode="offline")
    runs = list((sweep_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0


def test_confidence_rows_by_hand(sweep_dir):
    rows = {(r[0], r[1]): r[2:] for r in confidence_rows(load_sweep(sweep_dir), "maze")}
    # gepo at 8: last-evals scores (0.7+0.6)/2 = 0.65 and (0.9+0.6)/2 = 0.75 -> 0.70 ± t(0.975,1)·0.05 = 0.6353;
    # AUCs (1.1+1.3)/4 = 0.6 and (1.3+1.5)/4 = 0.7; against gepo online (0.75, 0.90): -0.10, -0.15 -> -0.125 ±
    # 12.706·0.025; against grpo at 8 (0.45, 0.25): +0.20, +0.50 -> 0.35 ± 12.706·0.15
    assert rows["gepo", "8"] == ["2", "0.700 [0.065, 1.335]", "0.650 [0.015, 1.285]", "-0.125 [-0.443, 0.193]",
                                 "0.350 [-1.556, 2.256]"]
    assert rows["gepo", "0"][3] == "—" and rows["grpo", "8"][4] == "—"  # the row is its own reference
    assert rows["grpo", "16"][:2] == ["1", "0.150 (n=1, no CI)"]  # one finished seed: no interval
    md = write_report(sweep_dir).read_text()
    assert "### Scores with 95 % confidence intervals" in md and "| gepo | 8 | 2 | 0.700 [0.065, 1.335] |" in md
