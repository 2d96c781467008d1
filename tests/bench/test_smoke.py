"""Smoke tests of the benchmarks: each runs small and prints its ratios against its baseline. They assert that
it ran and what it printed, never the ratios' values (these machines are shared and noisy)."""

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.bench


def test_bench_engine_prints_a_ratio():
    out = run_cli("bench", "engine", "--batch", "8", "--group-size", "4", "--max-tokens", "4", "--repeats", "1")
    assert out.returncode == 0, out.stderr
    ratios = [float(part.split("x")[0]) for part in out.stdout.split("ratio (ours / generate)")[1:]]
    assert len(ratios) == 2 and min(ratios) > 0  # distinct prompts, then groups
    assert "2 prompts x 4 samples" in out.stdout
    packed = float(out.stdout.split("ratio (packed / per row)")[1].split("x")[0])
    assert packed > 0


@pytest.mark.vllm
def test_bench_engine_with_vllm_prints_its_ratios():
    pytest.importorskip("vllm", reason="the vLLM lane: `make vllm`, then `make test-vllm`")
    out = run_cli("bench", "engine", "--engine", "vllm", "--batch", "8", "--group-size", "4", "--max-tokens", "4",
                  "--repeats", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    ratios = [float(part.split("x")[0]) for part in out.stdout.split("ratio (vLLM / ours)")[1:]]
    assert len(ratios) == 2 and min(ratios) > 0, out.stdout
    assert out.stdout.count("vLLM   ") >= 2  # its tokens/s line in both comparisons


def test_bench_losses_times_every_loss_against_grpo():
    out = run_cli("bench", "losses", "--batch", "16", "--length", "32", "--repeats", "1", "--warmup", "0")
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()[2:]}
    assert {"gepo", "gepo_defensive", "gspo", "tis", "m2po", "decoupled_ppo"} <= set(rows)
    assert rows["grpo"][-1] == "1.00x" and float(rows["gepo"][-1].rstrip("x")) > 0


def test_bench_transport_measures_both_channels_against_raw_pyzmq():
    out = run_cli("bench", "transport", "--trajectories", "400", "--workers", "1,2", "--prompt-tokens", "64",
                   "--completion-tokens", "256", "--weights-mib", "8", "--repeats", "1")
    assert out.returncode == 0, out.stderr
    ratios = [float(part.split("x")[0]) for part in out.stdout.split("ratio ")[1:]]
    assert len(ratios) == 3 and all(r > 0 for r in ratios)  # 1 worker, 2 workers, weights
    assert "trajectories, 2 workers" in out.stdout and "receiver peak RSS" in out.stdout


def test_bench_async_runs_both_workloads_and_prints_ratio_waste_and_bound():
    out = run_cli("bench", "async", "--steps", "3", "--prompts", "4", "--group-size", "4", "--add3-steps", "3",
                  "task.options.eval_size=16")
    assert out.returncode == 0, out.stdout + out.stderr
    maze, add3 = out.stdout.split("\nmaze (balanced)")[1].split("\nadd3 (learner-bound)")
    for section, modes in ((maze, {"sync", "async"}), (add3, {"sync", "async", "rl"})):
        rows = {line.split()[0]: line.split() for line in section.splitlines()
                if line.startswith(tuple(f"  {m} " for m in modes)) and line.split()[1] != "/"}
        assert set(rows) == modes and all(float(r[1]) > 0 for r in rows.values())
        assert float(rows["sync"][4]) == 0.0  # sync trains on-policy only
        assert all(0.0 <= float(r[5].rstrip("%")) <= 100.0 for r in rows.values())  # the share wasted
        ratio = float(section.split("async / sync:")[1].split("x")[0])
        bound = float(section.split("overlap bound of this workload:")[1].split("x")[0])
        assert ratio > 0 and 1.0 <= bound <= 2.0
    assert "async / rl (one process, all cores per phase):" in add3


def test_bench_simulate_prints_live_and_simulated_staleness():
    out = run_cli("bench", "simulate", "--steps", "4", "--workers", "1", "--weights-delay-s", "0.3")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {line.split()[0]: [float(v) for v in line.split()[1:5]] for line in out.stdout.splitlines()
            if line.startswith(("  live ", "  simulated "))}
    assert set(rows) == {"live", "simulated"}
    assert all(0 <= mean <= maximum <= 16 for mean, _, _, maximum in rows.values())  # inside the buffer's bound
    assert "simulated / live mean staleness:" in out.stdout


def test_async_bench_overlap_bound():
    from heterorl.bench.async_modes import overlap_bound

    assert overlap_bound(0.4, 0.4) == pytest.approx(2.0)  # equal halves: perfect overlap doubles throughput
    assert overlap_bound(0.74, 0.31) == pytest.approx((0.74 + 0.31) / 0.74)  # training-bound: far below 2
    assert overlap_bound(0.2, 0.6) == pytest.approx(0.8 / 0.6)  # sampling-bound alike
    assert overlap_bound(0.0, 0.0) is None
