"""Remote training sessions over real HTTP on loopback: the same primitives, results and errors as local ones."""

import random

import httpx
import pytest
import torch

from heterorl.engines.base import SamplingParams
from heterorl.errors import HeteroRLError
from heterorl.policies import load_policy
from heterorl.service.client import connect
from heterorl.service.server import ServerThread, create_app
from heterorl.service.sessions import Service
from heterorl.training.session import AdamParams, Datum, TrainingClient

BASE = "add3-sft-base"
KEY = "test-key-123"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    service = Service(tmp_path_factory.mktemp("state"), result_ttl_s=60)
    with ServerThread(create_app(service, api_key=KEY, max_body_bytes=2 * 2**20)) as server:
        yield server, service
    service.close()


@pytest.fixture
def client(served):
    server, _ = served
    with connect(server.url, api_key=KEY) as service:
        yield service


def _batch(tokenizer, n: int = 8, seed: int = 0) -> list[Datum]:
    """Groups of 4 completions of 3-digit sums, with rewards and behaviour log-probs (an RL batch)."""
    rng = random.Random(seed)
    datums = []
    for i in range(n):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        prompt = tokenizer.encode(f"{a}+{b}=")
        completion = tokenizer.encode(str(a + b + rng.choice([0, 0, 1, 10])))
        datums.append(Datum(tokens=prompt + completion, prompt_len=len(prompt), reward=float(i % 2),
                            group_id=i // 4, behaviour_logprobs=[-0.5] * len(completion)))
    return datums


def test_the_same_batch_locally_and_remotely_gives_the_same_loss_and_weights_bit_for_bit(client):
    model, tokenizer = load_policy(BASE)
    local = TrainingClient(model, tokenizer, seed=0)
    remote = client.create_training_client(BASE, seed=0)
    datums = _batch(tokenizer)
    for loss in ("gepo", "grpo"):
        got_local = local.forward_backward(datums, loss_fn=loss, loss_config={"clip_eps": 0.2}).result()
        got_remote = remote.forward_backward(datums, loss_fn=loss, loss_config={"clip_eps": 0.2}).result()
        assert got_remote.loss == got_local.loss and got_remote.logprobs == got_local.logprobs
        assert got_remote.metrics == got_local.metrics
    step_local = local.optim_step(AdamParams(learning_rate=1e-3)).result()
    step_remote = remote.optim_step(AdamParams(learning_rate=1e-3)).result()
    assert (step_remote.grad_norm, step_remote.step) == (step_local.grad_norm, step_local.step)
    version_local, state_local = local.save_weights_for_sampler().result()
    version_remote, state_remote = remote.save_weights_for_sampler().result()
    assert version_remote == version_local == 1 and set(state_remote) == set(state_local)
    assert all(torch.equal(state_remote[k], state_local[k]) for k in state_local)
    assert not torch.equal(state_local["lm_head.weight"], load_policy(BASE)[0].state_dict()["lm_head.weight"])
    forward_local = local.forward(datums, loss_fn="cross_entropy").result()
    assert remote.forward(datums, loss_fn="cross_entropy").result().loss == forward_local.loss
    local.close()
    remote.close()


def test_a_remote_sampler_samples_what_a_local_one_does_and_scores_the_same_logprobs(client):
    model, tokenizer = load_policy(BASE)
    local = TrainingClient(model, tokenizer, seed=0).save_weights_and_get_sampling_client()
    remote_training = client.create_training_client(BASE, seed=0)
    remote = remote_training.save_weights_and_get_sampling_client()
    assert remote.version == local.version == 1 and remote.model.endswith("/1")
    prompts = [remote.tokenizer.encode(p) for p in ("123+456=", "901+99=")]
    assert prompts == [tokenizer.encode(p) for p in ("123+456=", "901+99=")]  # the session's own tokenizer
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=7)
    got_remote = remote.sample(prompts, num_samples=3, sampling_params=params).result()
    got_local = local.sample(prompts, num_samples=3, sampling_params=params).result()
    assert [[s.tokens for s in g] for g in got_remote] == [[s.tokens for s in g] for g in got_local]
    assert [[s.logprobs for s in g] for g in got_remote] == [[s.logprobs for s in g] for g in got_local]
    single = remote.sample(prompts[0], num_samples=2, sampling_params=params).result()
    assert len(single) == 2 and single[0].text == got_local[0][0].text
    tokens = prompts[0] + got_local[0][0].tokens
    assert remote.compute_logprobs(tokens).result() == local.compute_logprobs(tokens).result()
    remote_training.close()


def test_state_saved_and_loaded_by_name_on_the_service(client):
    remote = client.create_training_client(BASE, seed=0)
    datums = _batch(remote.tokenizer)
    remote.forward_backward(datums).result()
    remote.optim_step().result()
    assert remote.save_state("after-one-step.pt").result() == "after-one-step.pt"
    before = remote.forward(datums).result().loss
    remote.forward_backward(datums).result()
    remote.optim_step().result()
    assert remote.forward(datums).result().loss != before
    assert remote.load_state("after-one-step.pt").result() == 0
    assert remote.forward(datums).result().loss == before
    with pytest.raises(HeteroRLError, match="no folders"):
        remote.save_state("../outside.pt").result()
    with pytest.raises(HeteroRLError, match="saved no state named"):
        remote.load_state("never-saved.pt").result()
    remote.close()


def test_a_lora_session_trains_saves_and_exports_the_adapter_as_a_local_one_does(client):
    from heterorl.config import LoraConfig

    assert {"add3-sft-base", "arith-hash-sft-base"} <= set(client.list_base_models())
    remote = client.create_lora_training_client(BASE, rank=4, seed=0)
    local = TrainingClient(*load_policy(BASE), seed=0, lora=LoraConfig(rank=4, alpha=8.0))
    assert remote.lora.to_dict() == local.lora.to_dict() and remote.adapter_meta == local.adapter_meta
    datums = _batch(local.tokenizer)
    for training in (local, remote):
        training.forward_backward(datums, loss_fn="gepo").result()
        training.optim_step(AdamParams(learning_rate=1e-2)).result()
    _, adapter_local = local.save_weights_for_sampler(form="adapter").result()
    version, adapter_remote = remote.save_weights_for_sampler(form="adapter").result()
    assert version == 1 and set(adapter_remote) == set(adapter_local)
    assert all(torch.equal(adapter_remote[k], adapter_local[k]) for k in adapter_local)
    assert remote.save_state("adapter.pt").result() == "adapter.pt"
    remote.forward_backward(datums, loss_fn="gepo").result()
    remote.optim_step(AdamParams(learning_rate=1e-2)).result()
    assert remote.load_state("adapter.pt").result() == 1
    _, whole = remote.save_weights_for_sampler().result()  # the base with the adapter merged
    assert torch.equal(whole["model.norm.weight"], load_policy(BASE)[0].state_dict()["model.norm.weight"])
    with pytest.raises(HeteroRLError, match="'attn' is not a linear layer"):
        client.create_lora_training_client(BASE, rank=4, target_modules=["attn"])
    with pytest.raises(HeteroRLError, match="rank 4096 exceeds"):
        client.create_lora_training_client(BASE, rank=4096)
    with pytest.raises(HeteroRLError, match="form='adapter'. needs a LoRA client"):
        client.create_training_client(BASE).save_weights_for_sampler(form="adapter").result()
    remote.close()


def test_refusals_name_what_is_wrong_and_the_service_lives_on(served, client):
    server, service = served
    remote = client.create_training_client(BASE)
    datums = _batch(remote.tokenizer)
    with pytest.raises(HeteroRLError, match="no_such_loss"):  # the registry's own error, passed through
        remote.forward_backward(datums, loss_fn="no_such_loss").result()
    with pytest.raises(HeteroRLError, match="registered name"):
        remote.forward_backward(datums, loss_fn=lambda batch, config: None)
    with pytest.raises(HeteroRLError, match="prompt_len"):  # a datum the trainer refuses, as locally
        remote.forward_backward([Datum(tokens=[1, 2], prompt_len=2)]).result()
    http = httpx.Client(base_url=server.url)
    assert http.get("/api/v1/sessions").status_code == 401  # no key: nothing runs
    wrong = {"Authorization": "Bearer wrong"}
    assert http.post(f"/api/v1/sessions/{remote.session_id}/calls", headers=wrong,
                     json={"method": "optim_step"}).status_code == 401
    ok = {"Authorization": f"Bearer {KEY}"}
    missing = http.get("/api/v1/futures/f-nope", headers=ok)
    assert missing.status_code == 404 and "f-nope" in missing.json()["detail"]
    unknown = http.post("/api/v1/sessions/s-nope/calls", headers=ok, json={"method": "optim_step"})
    assert unknown.status_code == 404 and "s-nope" in unknown.json()["detail"]
    malformed = http.post(f"/api/v1/sessions/{remote.session_id}/calls", headers=ok, json={"args": {}})
    assert malformed.status_code == 422 and "method" in str(malformed.json()["detail"])
    garbage = http.post(f"/api/v1/sessions/{remote.session_id}/calls", headers={**ok, "Content-Type":
                        "application/json"}, content=b"{not json")
    assert garbage.status_code == 422
    huge = http.post(f"/api/v1/sessions/{remote.session_id}/calls", headers=ok, content=b"x" * (3 * 2**20))
    assert huge.status_code == 413
    bad_method = http.post(f"/api/v1/sessions/{remote.session_id}/calls", headers=ok, json={"method": "rm"})
    assert bad_method.status_code == 400 and "unknown training method" in bad_method.json()["detail"]
    assert remote.forward(datums).result().loss > 0  # and the session still works
    remote.close()


def test_a_retried_request_runs_once_and_a_result_outlives_the_connection_that_asked(served):
    server, service = served
    ok = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, headers=ok) as http:
        session = http.post("/api/v1/sessions", json={"base_model": BASE, "seed": 0}).json()["session_id"]
        body = {"method": "save_weights_for_sampler", "request_id": "retry-me"}
        first = http.post(f"/api/v1/sessions/{session}/calls", json=body).json()["future_id"]
    with httpx.Client(base_url=server.url, headers=ok) as again:  # a new connection, the same request
        assert again.post(f"/api/v1/sessions/{session}/calls", json=body).json()["future_id"] == first
        state = again.get(f"/api/v1/futures/{first}", params={"wait_s": 10}).json()
        assert state == {"status": "done", "result": {"kind": "value", "value": 1}}  # one version bump, not two
        assert again.get(f"/api/v1/sessions/{session}").json()["version"] == 1
        again.delete(f"/api/v1/sessions/{session}")


def test_a_wrong_key_or_address_fails_at_connect(served):
    server, _ = served
    with pytest.raises(HeteroRLError, match="401"):
        connect(server.url, api_key="wrong")
    with pytest.raises(HeteroRLError, match="did not answer"):
        connect("http://127.0.0.1:9", api_key=KEY, timeout_s=2)


def test_any_sampling_client_version_answers_openai_clients_under_the_services_key(served, client):
    import openai

    server, _ = served
    remote = client.create_training_client(BASE, seed=0)
    first = remote.save_weights_and_get_sampling_client()
    remote.forward_backward(_batch(remote.tokenizer)).result()
    remote.optim_step(AdamParams(learning_rate=1e-2)).result()
    second = remote.save_weights_and_get_sampling_client()
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    served_ids = {m.id for m in api.models.list().data}
    assert {first.model, second.model, f"heterorl:{remote.session_id}/latest", "latest"} <= served_ids
    for sampler in (first, second):  # each version answers with its own weights: greedy, as its own client does
        got = api.completions.create(model=sampler.model, prompt="123+456=", max_tokens=4, temperature=0)
        own = sampler.sample(remote.tokenizer.encode("123+456="), 1, SamplingParams(max_tokens=4, temperature=0))
        assert got.choices[0].text == own.result()[0].text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert client.sampling_client("latest").model == "latest"
    remote.close()
