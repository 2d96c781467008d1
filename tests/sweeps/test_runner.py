"""`heterorl sweep`, `heterorl report` and `heterorl compare`: the grid, presets, resuming, failures, reports."""

import json
import math
import os
from pathlib import Path

import pytest

from heterorl.config import load_config
from heterorl.errors import ConfigError
from heterorl.sweeps.runner import SweepRunner, delay_overrides, load_spec
from tests.conftest import run_cli

RUN = """
seed: 0
task:
  name: maze
  options: {size: 5, wall_density: 0.3, min_path_len: 3, eval_size: 8, eval_seed: 12345}
rollout: {group_size: 4, max_tokens: 24}
rl: {base: maze-sft-base, steps: 2, prompts_per_step: 4, eval_every: 2}
runtime: {workers: 2, groups_per_call: 2}
logging: {wandb_mode: disabled}
"""

SWEEP = """
name: tiny
config: run.yaml
mode: simulated
parallel: 2
seconds_per_step: 10
losses: [gepo, grpo]
delays: ["0", "4"]
seeds: [0]
"""


def write_sweep(tmp_path: Path, text: str = SWEEP) -> Path:
    (tmp_path / "run.yaml").write_text(RUN)
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    return path


def test_delay_presets_are_the_papers_settings():
    online = delay_overrides("0", 28.125)
    assert online["runtime.mode"] == "sync" and online["delay.down.kind"] == "none"
    steps = delay_overrides("16", 28.125)
    assert steps["buffer.max_staleness_steps"] == 16 and steps["delay.down.kind"] == "uniform"
    assert steps["delay.down.high_s"] == 16 * 28.125 and steps["delay.down.low_s"] == 0.0
    assert steps["delay.down.reorder"]  # each version its own delay: staleness spreads over [0, K]
    for kind in ("lognormal", "weibull"):
        paper = delay_overrides(kind, 28.125)
        assert (paper["delay.down.L_s"], paper["delay.down.U_s"], paper["delay.down.d0_s"], paper["delay.down.c"]) == \
            (60.0, 1920.0, 400.0, 0.995)
        assert paper["buffer.max_staleness_steps"] == math.ceil(1920 / 28.125)
    fast = delay_overrides("lognormal@3", 28.125)  # the paper's seconds on a learner ~9x faster
    assert fast["delay.seconds_per_step"] == 3.0 and fast["buffer.max_staleness_steps"] == 640
    assert fast["delay.down.kind"] == "lognormal" and fast["delay.down.d0_s"] == 400.0
    with pytest.raises(ConfigError, match="after '@' give the seconds per learner step"):
        delay_overrides("lognormal@-2", 28.125)
    with pytest.raises(ConfigError, match="not a preset"):
        delay_overrides("soon", 28.125)
    lag = delay_overrides("lag32", 28.125)
    assert lag["delay.fixed_lag_steps"] == 32 and lag["delay.down.kind"] == "none"


def test_a_fixed_lag_needs_the_simulation_and_no_delays():
    with pytest.raises(ConfigError, match="runtime.execution=simulated"):
        load_config(None, ["delay.fixed_lag_steps=4"])
    with pytest.raises(ConfigError, match="leave `delay.up` and `delay.down` at kind none"):
        load_config(None, ["delay.fixed_lag_steps=4", "runtime.execution=simulated", "delay.down.kind=constant"])
    with pytest.raises(ConfigError, match=">= 0"):
        load_config(None, ["delay.fixed_lag_steps=-1", "runtime.execution=simulated"])


_COMMITTED = Path(__file__).parents[2] / "experiments" / "configs"


@pytest.mark.parametrize("sweep, loss, task, lags", [("rg_arith_cpu.yaml", "opsm", "reasoning_gym", (2,)),
                                                     ("maze4_cpu.yaml", "m2po", "maze", (0, 2)),
                                                     ("add3_long.yaml", "gspo", "arithmetic", (2,))])
def test_a_miniature_of_each_committed_sweep_runs_its_own_config(tmp_path, sweep, loss, task, lags):
    """The committed sweep's file itself, cut down from the command line to 2-step cells at small fixed lags:
    its run config, shipped base, task and loss run end to end (the full sweeps take hours), and a fixed lag is
    exactly that lag at every step, from the first."""
    out = tmp_path / "out"
    done = run_cli("sweep", str(_COMMITTED / sweep), "--out", str(out), "seeds=[0]", f"losses=[{loss}]",
                   f"delays=[{', '.join(f'lag{k}' for k in lags)}]", "parallel=2",
                   "overrides={rl.steps: 2, rl.prompts_per_step: 4, rl.eval_every: 2, task.options.eval_size: 8}")
    assert done.returncode == 0, done.stdout + done.stderr
    file_run = load_config(_COMMITTED / load_spec(_COMMITTED / sweep).config)
    for k in lags:
        folder = out / "cells" / f"{loss}__dlag{k}__s0"
        summary = json.loads((folder / "summary.json").read_text())
        assert (summary["status"], summary["task"], summary["loss"], summary["steps"]) == ("done", task, loss, 2)
        assert summary["environment"]["packages"]["torch"] and summary["environment"]["threads_per_cell"] >= 1
        steps = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()][1:]
        assert [r["staleness/versions_mean"] for r in steps] == [k, k]  # from the first step: no ramp
        assert (summary["staleness_p50"], summary["staleness_p95"], summary["staleness_max"]) == (k, k, k)
        cell = load_config(folder / "cell_config.yaml")
        assert (cell.rl.base, cell.optim.lr, cell.rollout.group_size) == \
            (file_run.rl.base, file_run.optim.lr, file_run.rollout.group_size)  # the file's run, only shrunk
    if 0 in lags:
        assert json.loads((out / "sweep.json").read_text())["online_delay"] == "lag0"


def test_command_line_keys_replace_a_sweeps_lists_and_add_to_its_overrides(tmp_path):
    path = write_sweep(tmp_path, SWEEP.replace("[gepo, grpo]", "{gepo: {loss.name: gepo}, grpo: {loss.name: grpo}}")
                       + "overrides: {rl.steps: 3}\n")
    spec = load_spec(path, ["losses=[grpo]", "delays=[lag2]", "overrides={rl.prompts_per_step: 2}"])
    assert (spec.losses, spec.delays) == (["grpo"], ["lag2"])  # a list replaces the file's mapping
    assert spec.overrides == {"rl.steps": 3, "rl.prompts_per_step": 2}  # a mapping adds to the file's
    assert load_spec(path, ["seeds=[3, 4]"]).seeds == [3, 4]


def test_every_cell_resolves_to_a_valid_run_config(tmp_path):
    path = write_sweep(tmp_path, SWEEP + "grid: {optim.lr: [1.0e-4, 3.0e-4]}\noverrides: {rl.steps: 3}\n")
    sweep = SweepRunner(path, out=tmp_path / "out")
    assert len(sweep.cells) == 2 * 2 * 1 * 2
    cell = next(c for c in sweep.cells if c.loss == "grpo" and c.delay == "4" and c.extra["optim.lr"] == 3e-4)
    assert cell.name == "grpo+optim.lr=0.0003__d4__s0"
    cfg = sweep.resolve(cell)
    assert (cfg.loss.name, cfg.optim.lr, cfg.rl.steps, cfg.runtime.execution) == ("grpo", 3e-4, 3, "simulated")
    assert cfg.delay.down.high_s == 40.0 and cfg.buffer.max_staleness_steps == 4
    assert cfg.logging.run_dir == str(tmp_path / "out" / "cells" / cell.name)


def test_bad_sweep_files_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_spec(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="paralel"):
        load_spec(write_sweep(tmp_path, SWEEP + "paralel: 3\n"))
    with pytest.raises(ConfigError, match="mode"):
        load_spec(write_sweep(tmp_path, SWEEP.replace("simulated", "imagined")))
    with pytest.raises(ConfigError, match="grpoo"):
        SweepRunner(write_sweep(tmp_path, SWEEP.replace("grpo]", "grpoo]")))
    with pytest.raises(ConfigError, match="rl.stepz"):
        sweep = SweepRunner(write_sweep(tmp_path, SWEEP + "overrides: {rl.stepz: 3}\n"))
        sweep.resolve(sweep.cells[0])
    with pytest.raises(ConfigError, match="config"):
        SweepRunner(write_sweep(tmp_path, SWEEP.replace("run.yaml", "missing.yaml")))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_spec(write_sweep(tmp_path, SWEEP + "seeds: [1]\n"))  # a duplicate key


@pytest.mark.slow
def test_a_sweep_runs_every_cell_resumes_and_reports(tmp_path):
    path = write_sweep(tmp_path)
    out = tmp_path / "out"
    done = run_cli("sweep", str(path), "--out", str(out), "losses=[gepo]")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 to run" in done.stdout
    cells = sorted(p.name for p in (out / "cells").iterdir())
    assert cells == ["gepo__d0__s0", "gepo__d4__s0"]
    summaries = {c: json.loads((out / "cells" / c / "summary.json").read_text()) for c in cells}
    assert all(s["status"] == "done" and s["steps"] == 2 and s["execution"] == "simulated"
               for s in summaries.values())
    assert summaries["gepo__d0__s0"]["staleness_max"] == 0  # online: sync mode
    report = (out / "report" / "summary.md").read_text()
    assert "| gepo | 4 |" in report and (out / "report" / "final_vs_delay_maze.png").is_file()
    # resumable: nothing reruns; a lost cell reruns alone; a changed config reruns what it changes
    (out / "cells" / "gepo__d4__s0" / "summary.json").unlink()
    again = run_cli("sweep", str(path), "--out", str(out), "losses=[gepo]")
    assert again.returncode == 0 and "1 done already, 1 to run" in again.stdout, again.stdout + again.stderr
    changed = run_cli("sweep", str(path), "--out", str(out), "overrides={loss.options: {clip_eps: 0.1}}",
                       "losses=[gepo]", "delays=['0']")
    assert changed.returncode == 0 and "0 done already, 1 to run" in changed.stdout, changed.stdout + changed.stderr


def test_a_cell_whose_loss_option_is_refused_stops_the_sweep_before_any_cell_runs(tmp_path):
    path = write_sweep(tmp_path, SWEEP.replace(
        "losses: [gepo, grpo]",
        "losses: {gepo: {loss.name: gepo}, broken: {loss.name: gepo, loss.options.clip_eps: -1}}"))
    result = run_cli("sweep", str(path), "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and not (tmp_path / "out" / "cells" / "gepo__d0__s0" / "summary.json").exists()
    assert "cell broken__d0__s0: config key `loss.options` = {'clip_eps': -1}: clip_eps=-1: must be >= 0" in (
        result.stderr)


@pytest.mark.slow
def test_a_failing_cell_is_reported_and_the_others_finish(tmp_path):
    path = write_sweep(tmp_path, SWEEP.replace('delays: ["0", "4"]', 'delays: ["0"]').replace(
        "losses: [gepo, grpo]",  # (a bad loss option is refused when the sweep plans: a missing policy is not)
        f"losses: {{gepo: {{loss.name: gepo}}, broken: {{loss.name: gepo, rl.base: {tmp_path / 'no-such-policy'}}}}}"))
    out = tmp_path / "out"
    result = run_cli("sweep", str(path), "--out", str(out))
    assert result.returncode == 1
    assert "1 cells failed: broken__d0__s0" in result.stderr
    failed = json.loads((out / "cells" / "broken__d0__s0" / "summary.json").read_text())
    assert failed["status"] == "failed" and failed["log_tail"]
    assert json.loads((out / "cells" / "gepo__d0__s0" / "summary.json").read_text())["status"] == "done"
    assert "broken__d0__s0" in (out / "report" / "summary.md").read_text()  # listed as unfinished


def _processes_writing_into(folder: Path) -> list[int]:
    """Live processes whose command line names ``folder`` or that hold a file of it open (a live cell's learner
    and workers log into it, though their command lines do not name it)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if (proc / "stat").read_text().rpartition(")")[2].split()[0] == "Z":
                continue  # a zombie: gone but for its exit status
            named = str(folder) in (proc / "cmdline").read_bytes().decode(errors="replace")
            if named or any(os.readlink(fd).startswith(str(folder)) for fd in (proc / "fd").iterdir()):
                found.append(int(proc.name))
        except OSError:  # gone meanwhile
            pass
    return found


@pytest.mark.slow
def test_a_sweep_stopped_by_sigterm_stops_its_running_cells_whole_process_trees(tmp_path):
    """The cells run in sessions of their own, and a live cell's learner and workers in sessions of theirs;
    SIGTERM to the sweep (`kill`, `timeout`) stops every one of them before the sweep exits, or they would go on
    writing into folders the next run starts again."""
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import ENV, REPO

    (tmp_path / "run.yaml").write_text(RUN.replace("steps: 2,", "steps: 100000,"))  # runs until stopped
    path = tmp_path / "sweep.yaml"
    path.write_text(SWEEP.replace("parallel: 2", "parallel: 1").replace('["0", "4"]', '["0"]')
                    .replace("[gepo, grpo]", "[gepo]").replace("mode: simulated", "mode: live"))
    cell = tmp_path / "out" / "cells" / "gepo__d0__s0"
    sweep = subprocess.Popen([sys.executable, "-m", "heterorl.cli", "sweep", str(path), "--out", str(tmp_path / "out")],
                             env=ENV, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        while len(_processes_writing_into(cell)) < 4:  # the cell's `heterorl train`, its learner and 2 workers
            assert sweep.poll() is None, sweep.stderr.read().decode()
            assert time.monotonic() < deadline, f"the cell never started its learner and workers: " \
                f"{_processes_writing_into(cell)}"
            time.sleep(0.2)
        sweep.send_signal(signal.SIGTERM)
        assert sweep.wait(180) == 128 + signal.SIGTERM
        assert not _processes_writing_into(cell), "processes of the cell outlived its sweep"
        summary = cell / "summary.json"  # the learner's own, stopped by SIGTERM: not a cell the sweep recorded done
        assert not summary.exists() or json.loads(summary.read_text()).get("status") != "done"  # reruns next time
    finally:
        sweep.kill()
        for pid in _processes_writing_into(cell):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_compare_puts_losses_side_by_side_with_paired_intervals_and_plans_the_online_reference(tmp_path):
    (tmp_path / "run.yaml").write_text(RUN)
    result = run_cli("compare", "--losses", "gepo,grpo", "--delay", "4", "--config", str(tmp_path / "run.yaml"),
                      "--out", str(tmp_path / "cmp"), "--parallel", "2", "--seeds", "0,1", "--no-online")
    assert result.returncode == 0, result.stdout + result.stderr
    table = result.stdout[result.stdout.index("loss"):]
    assert "gepo" in table and "grpo" in table and "scores with 95 % confidence intervals" in table
    assert "vs same loss online [95% CI]" in table and "[" in table.split("vs grpo same delay")[1]
    assert sorted(p.name for p in (tmp_path / "cmp" / "cells").iterdir()) == [
        f"{loss}__d4__s{seed}" for loss in ("gepo", "grpo") for seed in (0, 1)]  # the online runs: see the dry run
    assert (tmp_path / "cmp" / "report" / "success_vs_step_maze_4.png").is_file()
    cfg = load_config(tmp_path / "cmp" / "cells" / "gepo__d4__s0" / "cell_config.yaml")
    assert cfg.delay.down.kind == "uniform" and cfg.runtime.mode == "async"
    lag = run_cli("compare", "--delay", "lag8", "--config", str(tmp_path / "run.yaml"), "--seeds", "0,1,2",
                  "--out", str(tmp_path / "lag"), "--dry-run")
    assert lag.returncode == 0 and lag.stdout.splitlines()[-1] == "12 runs; every config resolves", lag.stdout
    assert "gepo__dlag0__s0" in lag.stdout  # a lag's online reference is lag 0


@pytest.mark.slow
def test_a_live_cell_runs_the_real_processes_with_scaled_delays(tmp_path):
    (tmp_path / "run.yaml").write_text(RUN)
    result = run_cli("compare", "--losses", "gepo", "--delay", "1", "--mode", "live", "--config",
                      str(tmp_path / "run.yaml"), "--out", str(tmp_path / "live"))
    assert result.returncode == 0, result.stdout + result.stderr
    cell = tmp_path / "live" / "cells" / "gepo__d1__s0"
    summary = json.loads((cell / "summary.json").read_text())
    assert summary["status"] == "done" and summary["execution"] == "live" and summary["steps"] == 2
    assert (cell / "logs" / "learner.log").is_file() and (cell / "logs" / "worker-1.log").is_file()
    cfg = load_config(cell / "cell_config.yaml")
    assert cfg.delay.time_scale == 10.0 and cfg.delay.down.high_s == 28.125  # compare: the paper's S


def test_a_cells_environment_names_what_its_bits_depend_on(tmp_path):
    from heterorl.sweeps.environment import run_environment

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 fma avx512f amx_bf16 sse\n")
    env = run_environment(3, cpuinfo)
    assert env["threads_per_cell"] == 3 and env["cpu"] == "Some CPU"
    assert env["cpu_flags"] == ["avx2", "fma", "avx512f", "amx_bf16"]  # only the ones torch's kernels choose by
    assert env["packages"]["torch"] and env["packages"]["numpy"] and env["python"].count(".") == 2
    assert run_environment(1, tmp_path / "missing")["cpu_flags"] == []
