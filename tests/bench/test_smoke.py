"""Smoke tests of the benchmarks: each runs small and prints its ratios against its baseline. They assert that
it ran and what it printed, never the ratios' values (these machines are shared and noisy)."""

import importlib.util
import json

import pytest

from heterorl.tasks.jail import jail_support
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


def test_bench_engine_episodes_times_prefix_reuse_against_whole_prefills():
    out = run_cli("bench", "engine", "--episodes", "--repeats", "1", "--threads", "1")
    assert out.returncode == 0, out.stderr
    same = out.stdout.split("episodes with the same tokens both ways: ")[1].split(",")[0]
    assert int(same.split("/")[0]) >= 250 and same.endswith("/256"), out.stdout  # (256 here: log-probs agree to 1e-5)
    time_ratio, prefill_ratio = (float(x.split("x")[0]) for x in
                                 out.stdout.split("ratio (reuse / whole): ")[1].split(", ")[:2])
    assert 0 < time_ratio and 0 < prefill_ratio < 0.5, out.stdout  # (the time's ratio: a benchmark's, not asserted)


@pytest.mark.vllm
def test_bench_engine_with_vllm_prints_its_ratios():
    pytest.importorskip("vllm", reason="the vLLM lane: `make vllm`, then `make test-vllm`")
    out = run_cli("bench", "engine", "--engine", "vllm", "--batch", "8", "--group-size", "4", "--max-tokens", "4",
                  "--repeats", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    ratios = [float(part.split("x")[0]) for part in out.stdout.split("ratio (vLLM / ours)")[1:]]
    assert len(ratios) == 2 and min(ratios) > 0, out.stdout
    assert out.stdout.count("vLLM   ") >= 2  # its tokens/s line in both comparisons


@pytest.mark.vllm
def test_bench_engine_stream_puts_batch_and_streaming_side_by_side():
    pytest.importorskip("vllm", reason="the vLLM lane: `make vllm`, then `make test-vllm`")
    out = run_cli("bench", "engine", "--engine", "vllm", "--stream", "--groups", "8", "--in-flight", "4",
                  "--group-size", "2", "--repeats", "1", "--publish-every", "0.2")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line.startswith(("batch", "stream"))}
    assert set(rows) == {"batch", "stream", "stream+inflight"}, out.stdout
    assert rows["batch"][-1] == "1.00x" and float(rows["stream+inflight"][-1].rstrip("x")) > 0


def test_bench_losses_times_every_loss_against_grpo():
    out = run_cli("bench", "losses", "--batch", "16", "--length", "32", "--repeats", "1", "--warmup", "0")
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()[2:]}
    assert {"gepo", "gepo_defensive", "gspo", "tis", "m2po", "decoupled_ppo"} <= set(rows)
    assert rows["grpo"][-1] == "1.00x" and float(rows["gepo"][-1].rstrip("x")) > 0


def test_bench_transport_measures_both_channels_against_raw_pyzmq():
    out = run_cli("bench", "transport", "--trajectories", "100", "--workers", "1,2", "--prompt-tokens", "64",
                   "--completion-tokens", "256", "--weights-mib", "4", "--repeats", "1")
    assert out.returncode == 0, out.stderr
    ratios = [float(part.split("x")[0]) for part in out.stdout.split("ratio ")[1:]]
    assert len(ratios) == 3 and all(r > 0 for r in ratios)  # 1 worker, 2 workers, weights
    assert "trajectories, 2 workers" in out.stdout and "receiver peak RSS" in out.stdout


def test_bench_weights_measures_real_deltas_and_carries_them_over_the_link(tmp_path):
    out = run_cli("bench", "weights", "--models", "tiny", "--steps", "2", "--workers", "1", "--bandwidths", "1e9",
                  "--out", str(tmp_path / "weights.json"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "applied == bf16 cast of the master: all 2 versions" in out.stdout
    result = json.loads((tmp_path / "weights.json").read_text())["workloads"]["tiny lr 1e-04"]
    versions = result["versions"]
    assert [v["version"] for v in versions] == [1, 2]
    for v in versions:  # every tiny tensor is floating point: bf16 is half of fp32, and a delta less again
        assert v["fp32_bytes"] == 2 * v["bf16_bytes"] and v["delta_bytes"] < v["bf16_bytes"]
        assert 0 < v["changed_frac"] < 1 and sum(v["method_bytes"].values()) < v["delta_bytes"]
    on, off = sorted(result["transfers"], key=lambda t: not t["deltas"])
    assert on["deltas"] and not off["deltas"] and len(on["seconds"]) == len(off["seconds"]) == 2
    assert on["link_bytes"] == [v["delta_bytes"] for v in versions]  # the link carried the steps, nothing more
    assert off["link_bytes"] == [v["bf16_bytes"] for v in versions]
    assert on["stats"]["weights/deltas_applied"] == 2 and on["stats"]["weights/full_received"] == 1  # version 0
    assert off["stats"]["weights/full_received"] == 3 and "weights/deltas_applied" not in off["stats"]
    assert all(s > 0 for s in on["seconds"] + off["seconds"])


def test_bench_weights_reward_pays_for_the_sum_then_for_any_number():
    from heterorl.bench.weights import number_reward

    assert number_reward("12+34=", "12 + 34 = 46.", "46") == 1.0
    assert number_reward("12+34=", "It is 47 or 460", "46") == 0.5
    assert number_reward("12+34=", "a sum", "46") == 0.0


def test_bench_deltas_runs_each_setting_with_deltas_off_and_on_side_by_side(tmp_path):
    out = run_cli("bench", "deltas", "--steps", "3", "--prompts", "4", "--bandwidths-mbit", "8", "--modes", "async",
                  "task.options.eval_size=16", "--out", str(tmp_path / "deltas.json"))
    assert out.returncode == 0, out.stdout + out.stderr
    for label in ("staleness mean (versions)", "staleness mean (seconds)", "samples/s", "MB over the links"):
        assert f"async 8 Mbit/s {label}" in out.stdout, out.stdout
    pair = json.loads((tmp_path / "deltas.json").read_text())["async 8 Mbit/s"]
    off, on = pair["off"], pair["on"]
    assert not off["weights"]["deltas"] and on["weights"]["deltas"] and on["weights"]["dtype"] == "bfloat16"
    assert sum(off["staleness_hist"]) == sum(on["staleness_hist"]) == 3 * 4  # every group trained, in both
    assert on["weights"]["link_bytes"] < off["weights"]["link_bytes"]  # the same versions, as steps


def test_bench_service_times_remote_against_local_and_loads_the_openai_endpoint():
    out = run_cli("bench", "service", "--batch", "8", "--prompts", "4", "--group-size", "2", "--max-tokens", "3",
                  "--repeats", "1", "--clients", "2", "--seconds", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    for label in ("forward_backward + optim_step", "sample"):
        line = next(line for line in out.stdout.splitlines() if line.strip().startswith(label))
        assert float(line.split("remote / local")[1].split("x")[0]) > 0, line
    assert float(out.stdout.split("each: ")[1].split(" requests/s")[0]) > 0
    if importlib.util.find_spec("tinker") is not None:  # (installed by [dev]): the same calls through its SDK
        assert float(out.stdout.split("SDK / local ")[1].split("x")[0]) > 0, out.stdout
        assert float(out.stdout.split("SDK / local (one call) ")[1].split("x")[0]) > 0, out.stdout


def test_bench_async_runs_every_mode_and_prints_ratio_waste_and_bound():
    # the learner-bound workload, which runs all three modes; the maze workload is the same code on another config
    out = run_cli("bench", "async", "--workload", "add3", "--add3-steps", "3", "task.options.eval_size=16")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "\nmaze (balanced)" not in out.stdout
    section = out.stdout.split("\nadd3 (learner-bound)")[1]
    modes = {"sync", "async", "rl"}
    rows = {line.split()[0]: line.split() for line in section.splitlines()
            if line.startswith(tuple(f"  {m} " for m in modes)) and line.split()[1] != "/"}
    assert set(rows) == modes and all(float(r[1]) > 0 for r in rows.values())
    assert float(rows["sync"][4]) == 0.0  # sync trains on-policy only
    assert all(0.0 <= float(r[5].rstrip("%")) <= 100.0 for r in rows.values())  # the share wasted
    ratio = float(section.split("async / sync:")[1].split("x")[0])
    bound = float(section.split("overlap bound of this workload:")[1].split("x")[0])
    assert ratio > 0 and 1.0 <= bound <= 2.0
    assert "async / rl (one process, all cores per phase):" in section


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


def test_bench_reshard_times_gather_against_every_rank_sending_its_slices():
    out = run_cli("bench", "reshard", "--mb", "2", "--dim", "512", "--workers", "1,2", "--versions", "1",
                  "--bandwidths", "0,1e9")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if "gather / reshard" in line]
    assert len(rows) == 4  # (loopback, 1 Gbit/s) x (1, 2 workers)
    assert all(float(row.split("gather / reshard")[1].split("x")[0]) > 0 for row in rows)
    assert "(ideal 2.00x)" in rows[-1] and "resharding is at least" in out.stdout


def test_bench_lora_compares_learning_bytes_per_version_and_sampling_side_by_side():
    out = run_cli("bench", "lora", "--model", "arith-hash-sft-base", "--ranks", "4", "--versions", "1", "--steps",
                  "1", "--samples", "4", "--rounds", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "full fine-tuning" in out.stdout and "LoRA rank 16" in out.stdout
    line = next(line for line in out.stdout.splitlines() if "merged / adapter" in line)
    assert float(line.split("bytes")[-1].split("x")[0]) > 1  # the adapter is the smaller version
    assert "merged / unmerged" in out.stdout


def test_bench_sandbox_scores_programs_with_hanging_shares_in_each_sandbox_and_times_a_worker():
    isolation = "nsjail,weak" if jail_support().available else "weak"
    out = run_cli("bench", "sandbox", "--programs", "4", "--tests", "2", "--wall-s", "2", "--rounds", "1",
                  "--startup-runs", "2", "--isolation", isolation)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if "tests/s" in line]
    kinds = isolation.split(",")
    assert len(rows) == 3 * len(kinds) and "'timeout': 4" in rows[-1] and "'ok': 4" in rows[0]
    assert "ms per program" in out.stdout and ("x weak)" in rows[0]) == (len(kinds) == 2)
    assert "sampling only" in out.stdout and "scored while the next batch samples" in out.stdout


def test_the_stream_bench_weights_occupancy_by_time_not_by_how_often_it_looked(monkeypatch):
    from heterorl.bench import stream

    clock = iter([0.0, 1.0, 1.5, 4.0, 4.0])  # start; 4 in flight from 1 s; 2 from 1.5 s; the mean asked at 4 s
    monkeypatch.setattr(stream.time, "monotonic", lambda: next(clock))
    occupancy = stream._TimeWeighted()
    occupancy.set(4)
    occupancy.set(2)
    # 0 for 1 s, 4 for 0.5 s, 2 for 2.5 s: (0 + 2 + 5) / 4
    assert occupancy.mean() == 7 / 4


def test_bench_learner_prints_its_paths_against_the_full_logits():
    out = run_cli("bench", "learner", "--models", "add3-sft-base", "--groups", "2", "--group-size", "2",
                  "--prompt-tokens", "5", "--completion-tokens", "6", "--completion-spread", "0.5", "--repeats", "1",
                  "--threads", "1", "--tokens-per-microbatch", "12", "--paths", "chunked+micro,chunked+bf16")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if "tokens/s" in line]
    assert len(lines) == 3 and "full logits" in lines[0] and "(1.00x)" in lines[0], out.stdout
    deltas = [float(line.rsplit(" ", 1)[1]) for line in lines]
    assert "micro-batches of 12 tokens" in lines[1] and deltas[1] < 1e-4, out.stdout  # float32: the same log-probs
    assert "bfloat16" in lines[2] and deltas[2] > 0, out.stdout  # (its mismatch is printed, not asserted)
    assert "rows of" in out.stdout and "prompts shared" in out.stdout


def test_bench_learner_refuses_a_device_it_cannot_see():
    out = run_cli("bench", "learner", "--device", "cuda", "--models", "add3-sft-base")
    assert out.returncode == 2 and "torch sees no CUDA device" in out.stderr
    out = run_cli("bench", "learner", "--paths", "chunked,fast")
    assert out.returncode == 2 and "--paths: unknown fast" in out.stderr
