"""A well-formed trajectory can no longer stop the learner: a live learner (`Learner` + `LearnerServer` over real
loopback sockets) refuses every trajectory that breaks its contract, tells the sender why, and trains on."""

import json
import random
import threading
import time

import numpy as np
import pytest

from heterorl.config import load_config
from heterorl.engines.base import SampleOutput
from heterorl.errors import HeteroRLError
from heterorl.policies import load_policy
from heterorl.rollout.episodes import fit_max_tokens
from heterorl.runtime.learner import SKIPPED_BATCHES, Learner, learner_settings, trajectory_contract
from heterorl.runtime.worker import RolloutWorker, WorkerOptions, sampling_params, stamp_groups
from heterorl.tasks import make_task_from
from heterorl.training.session import TrainingClient
from heterorl.transport import LearnerServer, TransportTimeout, WorkerClient
from heterorl.transport.protocol import TrajectoryBatch, TrajectoryContract
from tests.conftest import maze_run, trajectory, wait_until

VOCAB, CONTEXT = 12, 256  # maze-sft-base: 12 token ids, 256 positions


def hostile_run(run_dir) -> str:
    return maze_run(run_dir, 3, eval_size=8, eval_every=100, runtime={"fleet_wait_s": 0, "checkpoint_every": 0})


def member(worker: str, group: str, j: int, **fields):
    """Member ``j`` of a valid group of 4 (ids inside the vocabulary, rewards that differ, version 0), ``fields``
    changed."""
    return trajectory(**({"trajectory_id": f"{group}-{j}", "group_id": group, "sampler_id": worker, "group_size": 4,
                          "completion_len": 2, "version": 0, "reward": float(j % 2), "sent_at": 0.0} | fields))


def poisoned(group: str, **poison) -> list:
    """A group of 4 whose first member carries ``poison``: the other three must be refused with it."""
    return [member("hostile", group, j, **(poison if j == 0 else {})) for j in range(4)]


def long_member(group: str, j: int, prompt_len: int, completion_len: int, **fields):
    """A hostile member of ``prompt_len`` + ``completion_len`` tokens, every id inside the vocabulary."""
    return member("hostile", group, j, prompt_tokens=np.full(prompt_len, 5, np.int32),
                  completion_tokens=np.full(completion_len, 9, np.int32),
                  behaviour_logprobs=np.full(completion_len, -0.5, np.float32),
                  policy_versions=np.zeros(completion_len, np.int32), **fields)


# group id → (the reason its first member is refused for, its 4 members, the first carrying the poison)
POISONS = {
    "h-ahead": ("version_ahead", poisoned("h-ahead", version=1001)),
    "h-vocab": ("token_out_of_vocab", poisoned("h-vocab", completion_tokens=np.array([2, VOCAB], np.int32))),
    "h-long": ("too_long", [long_member("h-long", 0, 8192, 8192)] + poisoned("h-long")[1:]),
    "h-logprob": ("logprob_below_floor", poisoned("h-logprob", behaviour_logprobs=np.full(2, -1e30, np.float32))),
    # a whole group claiming more completions than a prompt is sampled for: every member breaks the bound
    "h-size": ("group_too_large", [member("hostile", "h-size", j, group_size=64) for j in range(4)]),
    # our own: an id past the vocabulary in the prompt, and a sequence one token longer than the context
    "h-prompt": ("token_out_of_vocab", poisoned("h-prompt", prompt_tokens=np.array([5, 6, 7, 99], np.int32))),
    "h-edge": ("too_long", [long_member("h-edge", 0, CONTEXT - 6, 7)] + poisoned("h-edge")[1:]),
}
# exactly at the context: taken
FITS = [long_member("h-fits", j, CONTEXT - 6, 6) for j in range(4)]


def send(client: WorkerClient, group: list, stop: threading.Event | None = None) -> None:
    """Send ``group`` whole, waiting out back-pressure (until ``stop``)."""
    while group and not (stop is not None and stop.is_set()):
        try:
            client.send_many(group, 1.0)
            return
        except TransportTimeout as exc:  # back-pressure: the learner is behind
            group = group[exc.done:]


def test_a_hostile_worker_cannot_stop_the_learner_and_is_told_why(tmp_path):
    """Each poison passes the wire decoder and would kill the learner or exhaust its memory if it reached the
    model; the learner refuses it at intake, with the rest of its group, tells the sender why, counts it, and
    finishes its steps on the honest worker's data, which it all trains on."""
    (tmp_path / "run.yaml").write_text(hostile_run(tmp_path / "run"))
    cfg = load_config(tmp_path / "run.yaml")
    task = make_task_from(cfg.task)
    model, tokenizer = load_policy("maze-sft-base")
    training = TrainingClient(model, tokenizer, seed=0)
    contract = trajectory_contract(cfg, training.model)
    assert contract == TrajectoryContract(vocab_size=VOCAB, max_sequence_len=CONTEXT, group_size=4)
    server = LearnerServer("tcp://127.0.0.1:0", cfg.transport, admission_control=True,
                           settings=learner_settings(cfg, contract), contract=contract)
    learner = Learner(cfg, training, task, server, tmp_path / "run")
    outcome: dict = {}
    poison_done, stop = threading.Event(), threading.Event()
    honest_sent: set[str] = set()

    def train():
        try:
            outcome["result"] = learner.run()
        except BaseException as exc:  # asserted below
            outcome["error"] = exc

    def honest_worker():
        """Sends valid groups with the version it holds: one before the poison, the rest after it."""
        client = WorkerClient(server.control_endpoint, "honest", cfg.transport)
        outcome["honest_contract"] = TrajectoryContract.from_settings(client.wait_ready(30).settings)
        version, n = client.wait_weights(-1, 60)[0], 0
        while not stop.is_set():
            got = client.latest_weights()
            version = got[0] if got else version
            if not client.acquire_starts(1, timeout_s=0.2):  # a group starts on an admission permit
                continue
            group = [member("honest", f"honest-{n}", j, version=version) for j in range(4)]
            send(client, group, stop)
            honest_sent.update(t.key for t in group)
            n += 1
            if n == 1:
                poison_done.wait(60)
            time.sleep(0.01)
        outcome["honest_refused"] = list(client.rejections)
        client.close()

    honest = threading.Thread(target=honest_worker, daemon=True)
    learning = threading.Thread(target=train, daemon=True)
    learning.start()
    honest.start()
    hostile = WorkerClient(server.control_endpoint, "hostile", cfg.transport)
    try:
        assert TrajectoryContract.from_settings(hostile.wait_ready(30).settings) == contract  # stated in ready
        assert hostile.wait_weights(-1, 60) is not None  # version 0 is out: version 0 is not ahead
        assert hostile.acquire_starts(1, timeout_s=30) == 1  # its one valid group starts on a permit, as a worker's
        send(hostile, FITS)
        for _, group in POISONS.values():
            send(hostile, group)
        # a group's poisoned first member is refused, and members that arrive later in another message too
        send(hostile, poisoned("h-late", behaviour_logprobs=np.full(2, -1e30, np.float32))[:1])
        wait_until(lambda: any(r.startswith("h-late-0:") for r in hostile.rejections), 30, "h-late-0 refused")
        send(hostile, poisoned("h-late")[1:])
        refused = 4 * len(POISONS) + 4
        wait_until(lambda: len(hostile.rejections) >= refused and hostile.stats["acked"] >= len(FITS), 60,
                   "every poison refused")
        poison_done.set()
        learning.join(300)
        assert not learning.is_alive(), "the learner did not finish its steps"
    finally:
        poison_done.set()
        stop.set()
        honest.join(30)
        hostile.close()
        server.close()
    assert "error" not in outcome, outcome.get("error")
    assert outcome["result"].steps == 3 and learner.state.tally.groups_trained == 12

    # every poison, and the rest of its group, refused for its reason and counted by reason
    expected = {"rejected/version_ahead": 1, "rejected/token_out_of_vocab": 2, "rejected/too_long": 2,
                "rejected/logprob_below_floor": 2, "rejected/group_too_large": 4, "rejected/group_rejected": 21}
    counted = {k: v for k, v in server.stats.items() if k.startswith("rejected/")}
    assert counted == expected and server.stats["rejected"] == sum(expected.values()) == refused
    told = {r.split(": ")[0]: r.split(": ")[1] for r in hostile.rejections}
    for group, (reason, members) in POISONS.items():
        assert told[members[0].trajectory_id] == reason, (group, told)
        rest = "group_too_large" if reason == "group_too_large" else "group_rejected"
        assert [told[t.trajectory_id] for t in members[1:]] == [rest] * 3, (group, told)
    assert [told[f"h-late-{j}"] for j in range(4)] == ["logprob_below_floor"] + ["group_rejected"] * 3
    assert hostile.stats["acked"] == len(FITS)  # the one group within the contract was taken

    # the honest worker was told nothing, stated the same contract, and its data is what was trained
    assert outcome["honest_refused"] == [] and outcome["honest_contract"] == contract
    trained = learner.inbox.trained
    assert len(trained) == 48 and trained <= honest_sent | {t.key for t in FITS}
    assert len(trained & honest_sent) >= 44


@pytest.mark.parametrize("max_log_ratio", ["null", "10"])
def test_a_batch_whose_loss_is_not_finite_is_skipped_and_kept_for_inspection(tmp_path, max_log_ratio):
    """Without a contract a log-prob of -1e30 reaches the learner. With ``rl.max_log_ratio`` off, the loss refuses
    the batch as not finite and the learner runs no update on it; with the bound (the default), the group is
    dropped before the loss and the rest of its batch trains (docs/RELIABILITY.md, "Bounds on one group"). Either
    way the learner names it in ``skipped_batches.jsonl`` and finishes its steps."""
    (tmp_path / "run.yaml").write_text(hostile_run(tmp_path / "run"))
    cfg = load_config(tmp_path / "run.yaml", [f"rl.max_log_ratio={max_log_ratio}"])
    model, tokenizer = load_policy("maze-sft-base")
    server = LearnerServer("tcp://127.0.0.1:0", cfg.transport, admission_control=True, settings=learner_settings(cfg))
    records = []

    class Logger:
        def log(self, step, metrics):
            records.append(metrics)

    learner = Learner(cfg, TrainingClient(model, tokenizer, seed=0), make_task_from(cfg.task),
                      server, tmp_path / "run", logger=Logger())
    stop = threading.Event()
    bad = [member("w", "w-bad", j, behaviour_logprobs=np.full(2, -1e30, np.float32)) for j in range(4)]

    def worker():
        client = WorkerClient(server.control_endpoint, "w", cfg.transport)
        client.wait_ready(30)
        groups = [bad] + [[member("w", f"w-{n}", j) for j in range(4)] for n in range(100)]  # version 0 is never
        for group in groups:  # ahead of the learner; each group starts on an admission permit, as a worker's
            while not stop.is_set() and not client.acquire_starts(1, timeout_s=0.2):
                pass
            send(client, group, stop)
        client.close()

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    try:
        result = learner.run()
    finally:
        stop.set()
        thread.join(30)
        server.close()
    assert result.steps == 3
    lines = [json.loads(line) for line in (tmp_path / "run" / SKIPPED_BATCHES).read_text().splitlines()]
    (skipped,) = [line for line in lines if "w-bad-0" in line["trajectory_ids"]]
    steps = [r for r in records if "optim/updates" in r]
    assert len(steps) == 3
    if max_log_ratio == "10":
        assert skipped["trajectory_ids"] == [t.trajectory_id for t in bad]  # the group alone
        assert "rl.max_log_ratio = 10" in skipped["reason"]
        (step,) = [r for r in steps if "optim/dropped_groups" in r]
        assert step["optim/dropped_groups"] == 1 and step["optim/updates"] == 1
        return
    assert {t.trajectory_id for t in bad} <= set(skipped["trajectory_ids"]) and len(skipped["trajectory_ids"]) == 16
    assert "not finite" in skipped["reason"]
    assert sum(r.get("optim/skip_reason") == "bad_batch" for r in steps) == len(lines)


def test_an_honest_worker_keeps_the_contract_the_learner_states(tmp_path, silent_learner):
    """The rollout worker clips behaviour log-probs at the floor, caps each call's ``max_tokens`` so that prompt
    + completion fit the learner's context (and stops when a prompt alone does not), and refuses a policy with
    more token ids than the learner's model takes."""
    (tmp_path / "run.yaml").write_text(hostile_run(tmp_path / "run"))
    cfg = load_config(tmp_path / "run.yaml")
    task = make_task_from(cfg.task)
    problem = task.sample_train(random.Random(0))
    sample = SampleOutput(tokens=[2, 3, 4], logprobs=[-0.5, -1e30, float("-inf")], stop_reason="stop")
    (group,) = stamp_groups(task, "w", 0, 0, [problem], [[5, 6, 7]], [[sample]], 1.0, 2.0)
    assert group[0].behaviour_logprobs.tolist() == [-0.5, -50.0, -50.0]
    contract = TrajectoryContract(vocab_size=VOCAB, max_sequence_len=30, group_size=4)
    assert contract.breaches(TrajectoryBatch(group), 0) == []

    worker = RolloutWorker(WorkerOptions(silent_learner, "w"))  # never joins: the learner never answers
    try:
        worker.contract = contract
        params = sampling_params(cfg, "w", 0)
        assert fit_max_tokens(params, [[5] * 4, [5] * 10], 30).max_tokens == 20  # 30 − the longest prompt
        assert fit_max_tokens(params, [[5] * 4], 30).max_tokens == cfg.rollout.max_tokens == 24
        with pytest.raises(HeteroRLError, match="prompt of 30 tokens leaves no room"):
            fit_max_tokens(params, [[5] * 30], 30)
        model, _ = load_policy("maze-sft-base")
        worker._check_policy(model, "maze-sft-base")  # the learner's own policy: 12 token ids
        worker.contract = TrajectoryContract(vocab_size=VOCAB - 2, max_sequence_len=30)
        with pytest.raises(HeteroRLError, match="has 12 token ids but the learner's model takes 10"):
            worker._check_policy(model, "maze-sft-base")
    finally:
        worker.close()
