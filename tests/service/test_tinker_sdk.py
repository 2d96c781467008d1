"""Tinker's official SDK (`tinker`, unchanged) against `heterorl serve` over real HTTP on loopback: its quickstart
(SFT with cross_entropy, then sampling), an RL loop with importance_sampling that learns, the same numbers as
heterorl's own client for the same seed, checkpoints by tinker:// path, and the refusals it surfaces."""

import random

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from heterorl.policies import load_policy  # noqa: E402
from heterorl.service.client import lora_spec  # noqa: E402
from heterorl.service.server import ServerThread, create_app  # noqa: E402
from heterorl.service.sessions import Service  # noqa: E402
from heterorl.service.tinker import losses, protobuf  # noqa: E402
from heterorl.tasks import make_task  # noqa: E402
from heterorl.training.session import AdamParams, TrainingClient  # noqa: E402

KEY = "tinker-test-key"
SFT_BASE, RL_BASE, RANK = "add3-sft-base", "arith-hash-sft-base", 8


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TINKER_TELEMETRY", "0")
        service = Service(tmp_path_factory.mktemp("state"), result_ttl_s=120, memory_budget_mb=None)
        with ServerThread(create_app(service, api_key=KEY, max_body_bytes=8 * 2**20)) as server:
            yield server, service
        service.close()


@pytest.fixture
def sdk(served):
    server, _ = served
    client = tinker.ServiceClient(base_url=f"{server.url}/tinker", api_key=f"tml-{KEY}")
    yield client
    client.close("success").result()


def sft_datum(tokenizer, text: str, prompt: str) -> types.Datum:
    """The quickstart's datum: the whole text, trained on after the prompt (weights 0 on the prompt)."""
    tokens, n = tokenizer.encode(text), len(tokenizer.encode(prompt))
    weights = [0.0] * (n - 1) + [1.0] * (len(tokens) - n)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})


def rl_datum(prompt: list[int], tokens: list[int], logprobs: list[float], advantage: float) -> types.Datum:
    full = prompt + tokens
    pad = len(prompt) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
        "target_tokens": np.array(full[1:], dtype=np.int64),
        "logprobs": np.array([0.0] * pad + list(logprobs), dtype=np.float32),
        "advantages": np.array([0.0] * pad + [advantage] * len(tokens), dtype=np.float32)})


class LocalBackend:
    """The same loop over heterorl's own clients in this process: a `TrainingClient` with the LoRA adapter a
    Tinker model gets, the datums and losses converted as the service converts them."""

    def __init__(self, base: str, seed: int) -> None:
        model, self.tokenizer = load_policy(base)
        self.training = TrainingClient(model, self.tokenizer, seed=seed, lora=lora_spec(RANK))
        self.sampler = None

    def forward_backward(self, datums: list[types.Datum], loss: str) -> float:
        data = [protobuf.Datum(d.model_input.to_ints(), {k: np.asarray(v.to_numpy()) if hasattr(v, "to_numpy")
                                                         else np.asarray(v) for k, v in d.loss_fn_inputs.items()})
                for d in datums]
        for d in data:  # (as the SDK sends them: targets int64, the rest float32)
            d.inputs = {k: v.astype(np.int64 if k == "target_tokens" else np.float32) for k, v in d.inputs.items()}
        built, fn, config = losses.build(data, loss, {})
        return self.training.forward_backward(built, fn, config).result().loss

    def optim_step(self, lr: float) -> None:
        self.training.optim_step(AdamParams(learning_rate=lr, beta1=0.9, beta2=0.95, eps=1e-12,
                                            grad_clip_norm=None)).result()

    def snapshot(self) -> None:
        self.sampler = self.training.save_weights_and_get_sampling_client()

    def sample(self, prompt: list[int], n: int, params: types.SamplingParams) -> list[tuple[list[int], list[float]]]:
        from heterorl.engines.base import SamplingParams

        out = self.sampler.sample(prompt, n, SamplingParams(max_tokens=params.max_tokens, seed=params.seed,
                                                            temperature=params.temperature)).result()
        return [(s.tokens, np.asarray(s.logprobs, dtype=np.float32).tolist()) for s in out]


class SdkBackend:
    """The loop over Tinker's SDK against the service."""

    def __init__(self, sdk, base: str, seed: int) -> None:
        self.training = sdk.create_lora_training_client(base_model=base, rank=RANK, seed=seed).result()
        self.tokenizer = self.training.get_tokenizer()
        self.sampler = None

    def forward_backward(self, datums: list[types.Datum], loss: str) -> float:
        return self.training.forward_backward(datums, loss).result().metrics["loss:sum"]

    def optim_step(self, lr: float) -> None:
        self.training.optim_step(types.AdamParams(learning_rate=lr)).result()

    def snapshot(self) -> None:
        self.sampler = self.training.save_weights_and_get_sampling_client().result()

    def sample(self, prompt: list[int], n: int, params: types.SamplingParams) -> list[tuple[list[int], list[float]]]:
        out = self.sampler.sample(types.ModelInput.from_ints(prompt), n, params).result()
        return [(list(s.tokens), list(s.logprobs)) for s in out.sequences]


def rl_loop(backend, steps: int, prompts: int = 16, group: int = 8, lr: float = 1e-3, held_out: int = 0):
    """GRPO-style advantages (reward - group mean) with Tinker's importance_sampling on 3-digit sums answered
    "#### N"; seeded sampling. (held-out greedy success before, after, [mean reward per step], [loss per step])."""
    task = make_task("arithmetic", {"digits": 3, "ops": "+"})
    tokenizer, rng = backend.tokenizer, random.Random(0)

    def success() -> float:
        greedy = types.SamplingParams(max_tokens=12, temperature=0.0, seed=0)
        problems = task.eval_problems()[:held_out]
        return sum(task.reward(p, tokenizer.decode(backend.sample(tokenizer.encode(p.prompt), 1, greedy)[0][0],
                                                   skip_special_tokens=True)) for p in problems) / max(1, held_out)

    backend.snapshot()
    before, rewards, losses_seen = success(), [], []
    for step in range(steps):
        datums, step_rewards = [], []
        for k in range(prompts):
            problem = task.sample_train(rng)
            prompt = tokenizer.encode(problem.prompt)
            samples = backend.sample(prompt, group, types.SamplingParams(max_tokens=12, seed=step * 1000 + k))
            scores = [task.reward(problem, tokenizer.decode(t, skip_special_tokens=True)) for t, _ in samples]
            mean = sum(scores) / len(scores)
            datums += [rl_datum(prompt, t, lp, r - mean) for (t, lp), r in zip(samples, scores)]
            step_rewards += scores
        losses_seen.append(backend.forward_backward(datums, "importance_sampling"))
        backend.optim_step(lr)
        backend.snapshot()
        rewards.append(sum(step_rewards) / len(step_rewards))
    return before, success(), rewards, losses_seen


def test_the_quickstart_trains_with_cross_entropy_then_samples_and_scores(sdk):
    training = sdk.create_lora_training_client(base_model=SFT_BASE, rank=RANK, seed=0).result()
    tokenizer = training.get_tokenizer()
    data = [sft_datum(tokenizer, f"{a}+{b}={a + b}", f"{a}+{b}=") for a, b in [(123, 456), (301, 299), (777, 111)]]
    seen = []
    for _ in range(6):
        out = training.forward_backward(data, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        seen.append(out.metrics["loss:sum"])
        assert [len(o["logprobs"].tolist()) for o in out.loss_fn_outputs] == [len(d.model_input.to_ints())
                                                                               for d in data]
    assert seen[-1] < 0.5 * seen[0], seen  # the loss falls
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokenizer.encode("123+456="))
    result = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=6, stop=["9"], seed=1)).result()
    assert len(result.sequences) == 3
    for sequence in result.sequences:
        assert len(sequence.logprobs) == len(sequence.tokens) >= 1
        text = tokenizer.decode(sequence.tokens, skip_special_tokens=True)
        if sequence.stop_reason == "stop" and "9" in text:
            assert text.endswith("9")  # cut after the token that completed the stop string
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(tokenizer.encode("123+456=579"))).result()
    assert scored[0] is None and len(scored) == 11 and all(x < 0 for x in scored[1:])


def test_an_rl_loop_with_importance_sampling_learns(sdk):
    before, after, rewards, _ = rl_loop(SdkBackend(sdk, RL_BASE, seed=0), steps=15, held_out=128)
    assert after > before, (before, after, rewards)  # measured here: 0.305 -> 0.375


def test_the_sdk_gets_what_heterorls_own_client_gets_bit_for_bit(sdk):
    """The same seed through the SDK and the service, and through a local TrainingClient: the same losses,
    samples and rewards, to the last bit (SFT steps, then RL steps)."""
    runs = []
    for backend in (SdkBackend(sdk, RL_BASE, seed=3), LocalBackend(RL_BASE, seed=3)):
        data = [sft_datum(backend.tokenizer, f"{a}+{b}=#### {a + b}", f"{a}+{b}=") for a, b in [(123, 456), (250, 250)]]
        sft = []
        for _ in range(2):
            sft.append(backend.forward_backward(data, "cross_entropy"))
            backend.optim_step(1e-3)
        runs.append((sft, rl_loop(backend, steps=2, prompts=4, group=4)))
    assert runs[0] == runs[1]


def test_checkpoints_by_tinker_path_load_resume_and_list(sdk, served):
    server, _ = served
    training = sdk.create_lora_training_client(base_model=SFT_BASE, rank=4, seed=0,
                                               user_metadata={"renderer_name": "role_colon"}).result()
    tokenizer = training.get_tokenizer()
    data = [sft_datum(tokenizer, "12+34=46", "12+34=")]
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    path = training.save_state("ckpt1").result().path
    assert path == f"tinker://{training.model_id}/weights/ckpt1"
    before = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
    resumed = sdk.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.model_id.split(":")[0] == training.model_id.split(":")[0] != resumed.model_id
    assert resumed.forward(data, "cross_entropy").result().metrics["loss:sum"] == before
    for client in (training, resumed):  # the same step from the same state: the same loss after it
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert (training.forward(data, "cross_entropy").result().metrics["loss:sum"]
            == resumed.forward(data, "cross_entropy").result().metrics["loss:sum"])
    sampler_path = training.save_weights_for_sampler("s1").result().path
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    later_path = training.save_weights_for_sampler("s2").result().path
    prompt = types.ModelInput.from_ints(tokenizer.encode("12+34="))
    scores = []
    for path in (sampler_path, later_path, sampler_path):  # (one host session loads each checkpoint asked for)
        sampler = training.create_sampling_client(path)
        scores.append(sampler.compute_logprobs(prompt).result())
    assert scores[0] == scores[2] != scores[1]
    rest = tinker.RestClient(base_url=f"{server.url}/tinker", api_key=f"tml-{KEY}")
    run = rest.get_training_run_by_tinker_path(path).result()
    assert run.base_model == SFT_BASE and run.lora_rank == 4 and run.user_metadata == {"renderer_name": "role_colon"}
    listed = rest.list_checkpoints(training.model_id).result()
    assert {c.checkpoint_id for c in listed.checkpoints} == {"weights/ckpt1", "sampler_weights/s1",
                                                             "sampler_weights/s2"}
    with pytest.raises(tinker.BadRequestError, match="save_state: .* already has a checkpoint named 'ckpt1'"):
        training.save_state("ckpt1").result()


def test_losses_the_sdk_names_run_with_their_documented_semantics(sdk):
    training = sdk.create_lora_training_client(base_model=SFT_BASE, rank=4, seed=0).result()
    tokenizer = training.get_tokenizer()
    prompt, completion = tokenizer.encode("123+456="), tokenizer.encode("579")
    on_policy = training.forward([sft_datum(tokenizer, "123+456=579", "123+456=")], "cross_entropy").result()
    every = on_policy.loss_fn_outputs[0]["logprobs"].tolist()  # the learner's log-prob of every target
    lp = every[len(prompt) - 1:]
    datum = rl_datum(prompt, completion, lp, 2.0)
    datum.loss_fn_inputs["logprobs"] = types.TensorData.from_numpy(np.array(every, dtype=np.float32))  # q = p
    n = len(completion)
    # on-policy (q = p): importance_sampling is -sum(A) = -2n; ppo the same (ratio 1 is inside the clip)
    for loss in ("importance_sampling", "ppo"):
        assert training.forward([datum], loss).result().metrics["loss:sum"] == pytest.approx(-2.0 * n, rel=1e-5)
    # cispo: -sum(clip(1) * A * lp); dro: -sum(lp * A) (no penalty where q = p)
    assert training.forward([datum], "cispo").result().metrics["loss:sum"] == pytest.approx(-2.0 * sum(lp), rel=1e-5)
    assert training.forward([datum], "dro").result().metrics["loss:sum"] == pytest.approx(-2.0 * sum(lp), rel=1e-5)
    off = rl_datum(prompt, completion, [x - 1.0 for x in lp], 2.0)  # ratio e on every token: ppo clips it at 1.3
    got = training.forward([off], "ppo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}).result()
    assert got.metrics["loss:sum"] == pytest.approx(-2.0 * 1.3 * n, rel=1e-5)
    # one of heterorl's losses by name (its semantics: docs/LOSSES.md)
    assert np.isfinite(training.forward([datum, datum], "grpo").result().metrics["loss:sum"])


def test_calls_the_service_cannot_honour_are_4xx_naming_the_call_and_it_lives_on(sdk, served):
    server, service = served
    training = sdk.create_lora_training_client(base_model=SFT_BASE, rank=4, seed=0).result()
    tokenizer = training.get_tokenizer()
    data = [sft_datum(tokenizer, "12+34=46", "12+34=")]
    with pytest.raises(tinker.BadRequestError, match="unknown loss_fn 'bogus'"):
        training.forward_backward(data, "bogus").result()
    with pytest.raises(tinker.BadRequestError, match="stable_reinforce.*importance_sampling"):
        training.forward_backward(data, "stable_reinforce").result()
    shifted = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                          loss_fn_inputs={"target_tokens": [5, 6, 7], "weights": [1.0, 1.0, 1.0]})
    with pytest.raises(tinker.BadRequestError, match="shifted by one"):
        training.forward_backward([shifted], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="base_model 'Qwen/Qwen3-8B' is not served here"):
        sdk.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.BadRequestError, match="topk_prompt_logprobs is not supported"):
        sampler.sample(types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2),
                       include_prompt_logprobs=True, topk_prompt_logprobs=3).result()
    with pytest.raises(tinker.BadRequestError, match="max_tokens"):
        sampler.sample(types.ModelInput.from_ints([5, 6]), 10**4, types.SamplingParams(max_tokens=10**3)).result()
    url, header = f"{server.url}/tinker/api/v1", {"X-API-Key": f"tml-{KEY}"}
    bad = httpx.post(f"{url}/forward_backward", content=b"\x1a\xff\xff\xff\x0f", headers=header)
    assert bad.status_code == 422 and "ForwardBackwardRequest" in bad.text
    assert httpx.post(f"{url}/optim_step", json={"model_id": 3}, headers=header).status_code == 422
    billing = httpx.get(f"{url}/billing/balance", headers=header)
    assert billing.status_code == 404 and "billing is not supported" in billing.text
    assert httpx.post(f"{url}/create_session", json={}, headers={"X-API-Key": "tml-wrong"}).status_code == 401
    assert httpx.post(f"{url}/create_session", json={}, headers={"X-API-Key": KEY}).status_code == 200  # (no tml-)
    huge = httpx.post(f"{url}/forward_backward", content=b"\0" * (9 * 2**20), headers=header)
    assert huge.status_code == 413
    gone = httpx.post(f"{url}/retrieve_future", json={"request_id": "f-nope"}, headers=header)
    assert gone.status_code == 404 and "f-nope" in gone.text
    # a model with no lora_config is a full fine-tuning session
    session = httpx.post(f"{url}/create_session", json={}, headers=header).json()["session_id"]
    made = httpx.post(f"{url}/create_model", headers=header, json={"session_id": session, "model_seq_id": 0,
                                                                  "base_model": SFT_BASE}).json()
    result = httpx.post(f"{url}/retrieve_future", json={"request_id": made["request_id"]}, headers=header,
                        timeout=60).json()
    info = httpx.post(f"{url}/get_info", json={"model_id": result["model_id"]}, headers=header).json()
    assert info["is_lora"] is False and info["model_data"]["tokenizer_id"].endswith(SFT_BASE)
    assert training.forward(data, "cross_entropy").result().metrics["loss:sum"] > 0  # (it lives on)
    assert httpx.post(f"{url}/sessions/{session}/finish", json={"reason": {"type": "success"}},
                      headers=header).status_code == 200
    after = httpx.post(f"{url}/session_heartbeat", json={"session_id": session}, headers=header)
    assert after.status_code == 410 and "finished" in after.text  # (the SDK stops its heartbeats)
