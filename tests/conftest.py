"""What every test shares: the environment of a test run, the CLI as a real process, and the factories of
test objects (one of each: a trajectory, a small tiny policy)."""

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# In a parallel suite (`make test TEST_WORKERS=N`) each of the N processes, and every process its tests start,
# computes with one torch thread: two threads each in four processes on two cores spend their time spinning in
# OpenMP's barriers (measured: a 3 s SFT test took 40 s of wall and 25 s of CPU at -n 4 with torch's default).
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _threads in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_threads, "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_SILENT", "true")

# Ctrl-C reaches the processes the tests start, and the tests that send SIGINT test it, even when the suite
# itself was started where SIGINT is ignored (`cmd &` in a non-interactive shell): an ignored SIGINT is
# inherited across exec, and Python then installs no KeyboardInterrupt handler; a handler is reset to the
# default instead.
signal.signal(signal.SIGINT, signal.default_int_handler)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402

from heterorl.transport.protocol import Trajectory  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# a child process imports the checkout under test, whatever else is installed
ENV = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
MAZE_ALPHABET = ".#SG\n>UDLR"


def run_cli(*args: str, timeout: float = 600, cwd: Path | str = REPO) -> subprocess.CompletedProcess:
    """``heterorl ARGS`` as a real process; its output captured as text. The process is forked from one that has
    imported torch and transformers already, as `heterorl train` starts its learner and workers
    (heterorl.runtime.preloaded): each command saves the 3 CPU seconds of those imports, and is otherwise the
    command started by exec (its own session, arguments, environment, working folder, exit status)."""
    from heterorl.runtime.preloaded import ForkedChild, forking_enabled

    command = [sys.executable, "-m", "heterorl.cli", *args]
    # a command that names vLLM is started by exec, as the launcher starts its vLLM workers (vLLM starts processes
    # of its own)
    if not forking_enabled() or any("vllm" in arg for arg in args):
        return subprocess.run(command, capture_output=True, text=True, env=ENV, cwd=cwd, timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="heterorl-cli-") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        child = ForkedChild(list(args), out, ENV, cwd=cwd, err_path=err)
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise
        return subprocess.CompletedProcess(command, code, *(
            path.read_text(errors="replace") if path.exists() else "" for path in (out, err)))


def interrupted_cli(*args: str, run_dir: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """``heterorl ARGS`` as a real process sent SIGINT (a terminal's Ctrl-C) once its run in ``run_dir`` has
    logged a step after step 0; its exit status and output, once it has ended."""
    from heterorl.runs import read_metrics

    proc = subprocess.Popen([sys.executable, "-m", "heterorl.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=REPO)
    try:
        wait_until(lambda: (run_dir / "metrics.jsonl").is_file() and any(
            r["step"] >= 1 for r in read_metrics(run_dir / "metrics.jsonl")), timeout, "the run's first step")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def trajectory(*, completion_len: int | None = None, version: int | None = None, **fields) -> Trajectory:
    """A valid stamped trajectory; ``fields`` override any field. ``completion_len`` makes a completion of that
    many tokens (log-probs -0.5 each); ``version`` stamps every completion token with that policy version."""
    values = dict(
        trajectory_id="w0-17-3", group_id="w0-17", prompt_id="maze-ab12", sampler_id="w0", group_size=8,
        prompt_tokens=np.array([5, 6, 7, 8], dtype=np.int32), completion_tokens=np.array([9, 10, 1], dtype=np.int32),
        behaviour_logprobs=np.array([-0.1, -2.5, -0.01], dtype=np.float32),
        policy_versions=np.array([3, 3, 4], dtype=np.int32), reward=1.0, generation_start=10.0, generation_end=10.5,
        sent_at=11.0,
    )
    if completion_len is not None:
        values.update(completion_tokens=np.arange(2, 2 + completion_len, dtype=np.int32),
                      behaviour_logprobs=np.full(completion_len, -0.5, dtype=np.float32),
                      policy_versions=np.full(completion_len, 3, dtype=np.int32))
    if version is not None:
        values["policy_versions"] = np.full(len(values["completion_tokens"]), version, dtype=np.int32)
    return Trajectory(**(values | fields))


def maze_run(run_dir, steps: int, *, eval_size: int, eval_every: int, **sections: dict) -> str:
    """The YAML of the small run the runtime tests share: the 5x5 maze from the shipped SFT base, GEPO, groups of
    4, 4 prompts a step, 2 workers, no wandb, ``steps`` steps; ``sections`` (``runtime={...}``) are merged over
    it, section by section."""
    run = {
        "seed": 0,
        "task": {"name": "maze", "options": {"size": 5, "wall_density": 0.3, "min_path_len": 3,
                                             "eval_size": eval_size, "eval_seed": 12345}},
        "rollout": {"group_size": 4, "max_tokens": 24},
        "loss": {"name": "gepo"},
        "rl": {"base": "maze-sft-base", "steps": steps, "prompts_per_step": 4, "eval_every": eval_every},
        "runtime": {"workers": 2, "groups_per_call": 2},
        "logging": {"run_dir": str(run_dir), "wandb_mode": "disabled", "progress": False},
    }
    for name, values in sections.items():
        run[name] = {**run.get(name, {}), **values}
    return yaml.safe_dump(run, sort_keys=False)


def wait_until(predicate, timeout_s: float, what, step_s: float = 0.02):
    """Poll ``predicate`` until it returns something true, and return that; fail naming ``what`` after
    ``timeout_s`` (``what``: a string, or a function that says what it saw instead, called on failure). The one
    wait of the tests: none waits without failing when its time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, (f"timed out after {timeout_s:g} s waiting for "
                                             f"{what() if callable(what) else what}")
        time.sleep(step_s)


@contextlib.contextmanager
def ports_held_for_a_restart(run_dir):
    """Hold the learner's ports named in ``RUN_DIR/endpoints.json`` (a killed learner's, which the learner resumed
    after it binds again) against every other process until the block ends: each by a socket bound with
    SO_REUSEADDR and not listening, a port the kernel gives no one else, while ZeroMQ's bind (SO_REUSEADDR, then
    listen) still succeeds beside it. Enter it as soon as the old learner is dead: any process that asks the kernel
    for a free port between the kill and the restart could otherwise be given one of them."""
    import json
    import socket

    addresses = json.loads((Path(run_dir) / "endpoints.json").read_text()).values()
    holders = []
    try:
        for address in addresses:
            host, port = address.removeprefix("tcp://").rsplit(":", 1)
            holder = socket.socket()
            holders.append(holder)
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            holder.bind((host, int(port)))
        yield
    finally:
        for holder in holders:
            holder.close()


@pytest.fixture()
def silent_learner():
    """The address of a socket bound on a free loopback port (bound at :0 and read back, held for the test) that
    never answers: a learner a worker can dial but never hear from."""
    import zmq

    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    try:
        yield f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    finally:
        router.close(0)
        context.term()


@pytest.fixture(scope="session")
def tiny_policy():
    """A small random tiny policy over the maze alphabet (shared; do not train it in place)."""
    from heterorl.policies import TinyModelConfig, build_tiny_policy

    return build_tiny_policy(MAZE_ALPHABET + "0123456789+=# ", TinyModelConfig(hidden_size=64, num_layers=2,
                                                                               intermediate_size=128, seed=1))


def teacher_forced(model, context: list[int], tokens: list[int], temperature: float = 1.0,
                   top_k: int = 0, top_p: float = 1.0):
    """log p(tokens[t] | context, tokens[:t]) under ``model`` (a 1-D float tensor), from logits divided by
    ``temperature`` and filtered as the torch engine filters them: what an engine's sampled log-probs must equal."""
    import torch

    from heterorl.engines.torch_engine import _filter_logits

    with torch.no_grad():
        logits = model(torch.tensor([context + tokens])).logits[0, len(context) - 1 : -1].float()
    if temperature != 1.0 or top_k or top_p < 1.0:
        logits = _filter_logits(logits / temperature, top_k, top_p)
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def perturbed_state(model, seed: int, scale: float = 0.05) -> dict:
    """``model``'s state with seeded Gaussian noise of std ``scale`` added to every tensor: a different version."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {name: t + scale * torch.randn(t.shape, generator=gen) for name, t in model.state_dict().items()}


TEST_TIMES = os.environ.get("HETERORL_TEST_TIMES")  # a JSONL file: each test's wall and CPU seconds (scripts/)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ``HETERORL_TEST_TIMES=FILE``: append one line per test (setup, call and teardown together): its wall
    seconds and the CPU seconds of this process and of the children it waited for (`scripts/test_times.py` ranks
    and classifies them)."""
    if not TEST_TIMES:
        yield
        return
    import json
    import resource

    def cpu(who):
        usage = resource.getrusage(who)
        return usage.ru_utime + usage.ru_stime

    wall, own, children = time.monotonic(), cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN)
    yield
    line = {"test": item.nodeid, "wall_s": round(time.monotonic() - wall, 3),
            "cpu_s": round(cpu(resource.RUSAGE_SELF) - own, 3),
            "children_cpu_s": round(cpu(resource.RUSAGE_CHILDREN) - children, 3),
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}
    with open(TEST_TIMES, "a") as f:  # one short append per line: lines of parallel workers do not interleave
        f.write(json.dumps(line) + "\n")


# Tests that share something of the whole machine run in one xdist worker, one after another (`make test` runs
# the suite with `--dist loadgroup`): each group, the files that hold it, and what they share.
SERIAL_GROUPS = {
    "netlab": ("tests/netlab/",),  # network namespaces and links shaped to measured bandwidths (timing they assert)
    "ray": ("tests/deploy/test_ray_launcher.py",),  # Ray clusters: each head takes Ray's fixed default ports
}


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the test ids it schedules by
def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("xdist"):  # (the vLLM lane's venv runs in one process, without it)
        return
    for item in items:
        path = Path(str(item.fspath)).resolve().relative_to(REPO).as_posix()
        for group, prefixes in SERIAL_GROUPS.items():
            if path.startswith(prefixes):
                item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(trylast=True)  # after xdist's: a group it did not write into the test's id is not scheduled as one
def pytest_collection_finish(session):
    if not (os.environ.get("PYTEST_XDIST_WORKER") and session.config.getvalue("loadgroup")):
        return
    lost = [item.nodeid for item in session.items if item.get_closest_marker("xdist_group")
            and "@" not in item.nodeid.rpartition("]")[2].rpartition("::")[2]]
    if lost:
        raise pytest.UsageError(f"pytest-xdist's --dist loadgroup did not take the serial groups ({len(lost)} tests, "
                                f"{lost[0]} first): this pytest ({pytest.__version__}) and pytest-xdist do not work "
                                "together; install the versions setup.cfg's [dev] names (make install)")
