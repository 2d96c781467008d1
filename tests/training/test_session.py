"""Session primitives: futures in order, real learning, snapshots, state round trip, bad input."""

import copy
import random

import numpy as np
import pytest
import torch

import gepo
from heterorl.engines import SamplingParams
from heterorl.errors import HeteroRLError
from heterorl.training.session import AdamParams, Datum, TrainingClient, read_training_state


@pytest.fixture()
def training(tiny_policy):
    model, tok = tiny_policy
    return TrainingClient(copy.deepcopy(model), tok, seed=0)


def _datums(tok):
    pairs = [("S.#\n..G\n>", "DRR"), ("S.\n.G\n>", "RD"), ("S..\n#.G\n>", "RRD")]
    out = []
    for prompt, moves in pairs:
        p = tok(prompt)["input_ids"]
        out.append(Datum(tokens=p + tok(moves)["input_ids"] + [tok.eos_token_id], prompt_len=len(p)))
    return out


def test_cross_entropy_training_lowers_the_loss(training, tiny_policy):
    _, tok = tiny_policy
    datums = _datums(tok)
    before = training.forward(datums).result().loss
    for _ in range(30):
        training.forward_backward(datums, "cross_entropy")
        training.optim_step(AdamParams(learning_rate=3e-3))
    after = training.forward(datums).result().loss
    assert after < 0.5 * before
    assert training.step == 30


def test_futures_run_in_submission_order(training, tiny_policy):
    _, tok = tiny_policy
    datums = _datums(tok)
    futures = [training.forward_backward(datums), training.optim_step(), training.forward(datums)]
    results = [f.result() for f in futures]
    assert results[1].step == 1
    assert results[2].loss < results[0].loss  # the forward ran after the optimizer step


def test_forward_reports_completion_logprobs(training, tiny_policy):
    model, tok = tiny_policy
    d = _datums(tok)[0]
    out = training.forward([d]).result()
    with torch.no_grad():
        logits = training.model(torch.tensor([d.tokens])).logits[0]
    expected = torch.log_softmax(logits, -1)[torch.arange(d.prompt_len - 1, len(d.tokens) - 1),
                                             torch.tensor(d.tokens[d.prompt_len:])]
    assert torch.allclose(torch.tensor(out.logprobs[0]), expected, atol=1e-5)
    # cross entropy = mean negative log-prob of the completion tokens
    assert out.loss == pytest.approx(float(-expected.mean()), abs=1e-5)


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.5])
def test_learner_logprobs_match_the_samplers_at_its_temperature(training, tiny_policy, temperature):
    """On-policy, the learner's log-probs of sampled tokens equal the sampler's at the same temperature, so
    importance weights are exactly 1; at temperature 1 they would not be (unless it is 1)."""
    _, tok = tiny_policy
    sampler = training.save_weights_and_get_sampling_client()
    prompt = tok("S.#\n..G\n>")["input_ids"]
    params = SamplingParams(max_tokens=6, temperature=temperature, seed=3)
    samples = sampler.sample(prompt, num_samples=6, sampling_params=params).result()
    datums = [Datum(tokens=prompt + s.tokens, prompt_len=len(prompt), behaviour_logprobs=s.logprobs) for s in samples]
    out = training.forward(datums, temperature=temperature).result()
    for d, got in zip(datums, out.logprobs):
        assert torch.allclose(torch.tensor(got), torch.tensor(d.behaviour_logprobs), atol=1e-4)
    if temperature != 1.0:
        plain = training.forward(datums).result()
        assert not all(torch.allclose(torch.tensor(a), torch.tensor(d.behaviour_logprobs), atol=1e-3)
                       for d, a in zip(datums, plain.logprobs))
    with pytest.raises(HeteroRLError, match="temperature"):
        training.forward(datums, temperature=0).result()


def _group_datums(tok, seed=0):
    """Groups of completions behind shared prompts of different lengths, one lone prompt, shuffled."""
    import random

    rng = random.Random(seed)
    prompts = ["S.#\n..G\n>", "S.\n.G\n>", "S..#\n#..G\n...#\n>"]
    datums = []
    for g, prompt in enumerate(prompts):
        p = tok(prompt)["input_ids"]
        for _ in range(4 if g < 2 else 1):
            moves = "".join(rng.choice("UDLR") for _ in range(rng.randint(1, 7)))
            completion = tok(moves)["input_ids"] + [tok.eos_token_id]
            datums.append(Datum(tokens=p + completion, prompt_len=len(p), reward=float(rng.random() < 0.5),
                                group_id=g, behaviour_logprobs=[-1.0] * len(completion)))
    rng.shuffle(datums)
    return datums


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prompts_give_the_same_logprobs_and_gradients(tiny_policy, attention):
    """Packing a group's completions behind one copy of their prompt is an optimisation only: log-probs and
    gradients equal those of one row per datum."""
    from heterorl.engines.packing import plan, prompt_groups

    model, tok = tiny_policy
    model = copy.deepcopy(model)
    model.set_attn_implementation(attention)
    datums = _group_datums(tok)
    groups = prompt_groups([d.tokens for d in datums], [d.prompt_len for d in datums])
    assert sorted(len(g) for g in groups) == [1, 4, 4]
    assert plan(model, [d.tokens for d in datums], [d.prompt_len for d in datums]).shared_prompts
    results = {}
    for share in (False, True):
        client = TrainingClient(model, tok, share_prompts=share)
        model.zero_grad()
        out = client.forward_backward(datums, "grpo", temperature=0.7).result()
        results[share] = (out, torch.cat([p.grad.flatten() for p in model.parameters()]))
    (plain, plain_grad), (packed, packed_grad) = results[False], results[True]
    for a, b in zip(plain.logprobs, packed.logprobs):
        assert len(a) == len(b)
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
    assert packed.loss == pytest.approx(plain.loss, abs=1e-6)
    assert plain_grad.abs().sum() > 0
    assert torch.allclose(packed_grad, plain_grad, rtol=1e-4, atol=1e-7)


def test_prompts_are_shared_only_where_it_helps(tiny_policy, monkeypatch):
    from heterorl.engines.packing import plan

    model, tok = tiny_policy
    lone = _datums(tok)  # three different prompts: nothing to share
    tokens, lens = [d.tokens for d in lone], [d.prompt_len for d in lone]
    assert not getattr(plan(model, tokens, lens), "shared_prompts", False)
    grouped = _group_datums(tok)
    shared, shared_lens = [d.tokens for d in grouped], [d.prompt_len for d in grouped]
    assert plan(model, shared, shared_lens).shared_prompts
    other = copy.deepcopy(model)
    other.config._attn_implementation = "flash_attention_2"  # takes no custom 4D mask: position ids, one row
    varlen = plan(other, shared, shared_lens)
    assert not varlen.shared_prompts and len(varlen.rows) == 1
    monkeypatch.setattr("heterorl.engines.packing.PACK_MAX_MASK", 100)  # the mask would outgrow its memory budget
    assert plan(model, shared, shared_lens) is None


def test_sampling_client_is_a_frozen_versioned_snapshot(training, tiny_policy):
    _, tok = tiny_policy
    sampler = training.save_weights_and_get_sampling_client()
    assert sampler.version == 1
    prompt = tok("S.\n.G\n>")["input_ids"]
    before = sampler.compute_logprobs(prompt + [3, 4]).result()
    training.forward_backward(_datums(tok))
    training.optim_step(AdamParams(learning_rate=1e-2)).result()
    assert sampler.compute_logprobs(prompt + [3, 4]).result() == before  # training does not leak into it
    newer = training.save_weights_and_get_sampling_client()
    assert newer.version == 2
    assert newer.compute_logprobs(prompt + [3, 4]).result() != before
    samples = sampler.sample(prompt, num_samples=3, sampling_params=SamplingParams(max_tokens=5, seed=0)).result()
    assert len(samples) == 3 and all(isinstance(s.text, str) for s in samples)


def test_state_round_trip(training, tiny_policy, tmp_path):
    _, tok = tiny_policy
    datums = _datums(tok)
    training.forward_backward(datums)
    training.optim_step(AdamParams(learning_rate=1e-3)).result()
    training.save_weights_and_get_sampling_client()
    training.save_state(tmp_path / "state.pt").result()
    loss_saved = training.forward(datums).result().loss
    training.forward_backward(datums)
    training.optim_step(AdamParams(learning_rate=1e-2)).result()
    assert training.forward(datums).result().loss != loss_saved
    assert training.load_state(tmp_path / "state.pt").result() == 1
    assert training.forward(datums).result().loss == pytest.approx(loss_saved, abs=1e-7)
    assert (training.version, training.step) == (1, 1)
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]  # written atomically, no temp left


def test_state_loads_with_weights_only_and_restores_both_rngs(training, tiny_policy, tmp_path):
    """Everything a state holds (model, optimizer, version, step, torch's and python's RNG) loads under
    torch.load(weights_only=True), and the RNG streams go on where they were at the save."""
    _, tok = tiny_policy
    training.forward_backward(_datums(tok))
    training.optim_step(AdamParams(learning_rate=1e-3)).result()
    training.save_state(tmp_path / "state.pt").result()
    expected = (random.random(), torch.rand(3))
    random.random(), torch.rand(3)
    state = read_training_state(tmp_path / "state.pt")  # weights_only: a file that needs more is refused
    assert state["optimizer"]["state"] and (state["version"], state["step"]) == (0, 1)
    training.load_state(state).result()
    drawn = (random.random(), torch.rand(3))
    assert drawn[0] == expected[0] and torch.equal(drawn[1], expected[1])


def test_a_damaged_state_is_an_error_naming_the_file(training, tmp_path):
    """Truncated anywhere, random bytes, or pickled objects beyond tensors: one clear error, never a raw one."""
    good = tmp_path / "state.pt"
    training.save_state(good).result()
    data, rng = good.read_bytes(), np.random.default_rng(0)
    damaged = [data[:n] for n in (0, 10, len(data) // 3, len(data) - 1)] + [rng.bytes(n) for n in (1, 64, 4096) * 4]
    for i, blob in enumerate(damaged):
        path = tmp_path / f"bad-{i}.pt"
        path.write_bytes(blob)
        with pytest.raises(HeteroRLError, match=f"{path} cannot be read as a training state"):
            read_training_state(path)
    code = tmp_path / "code.pt"
    torch.save({"model": {}, "optimizer": None, "version": 0, "step": 0, "rng": HeteroRLError("x")}, code)
    with pytest.raises(HeteroRLError, match="holds more than tensors"):
        training.load_state(code).result()
    torch.save({"model": {}}, code)
    with pytest.raises(HeteroRLError, match="lacks optimizer, version, step, rng"):
        training.load_state(code).result()
    torch.save({**training.state_dict(), "model": {"nope": torch.zeros(1)}}, code)
    with pytest.raises(HeteroRLError, match="does not fit this model"):
        training.load_state(code).result()


def test_callable_loss_and_registered_policy_loss(training, tiny_policy):
    _, tok = tiny_policy
    datums = _datums(tok)
    for d, a in zip(datums, (1.0, -1.0, 0.5)):
        d.advantage = a
        d.behaviour_logprobs = [-1.0] * d.completion_len
    out = training.forward(datums, lambda batch, cfg: (batch.logprobs.sum() * 0, {"custom": 1.0})).result()
    assert out.metrics == {"custom": 1.0}
    out = training.forward(datums, "grpo", {"clip_eps": 0.1, "advantage": "given"}).result()
    assert "is/clip_frac" in out.metrics and torch.isfinite(torch.tensor(out.loss))
    with pytest.raises(gepo.LossInputError, match="needs `rewards`"):  # grpo's default estimates from rewards
        training.forward(datums, "grpo").result()


def test_losses_estimate_advantages_from_rewards_and_see_staleness(training, tiny_policy):
    _, tok = tiny_policy
    training.save_weights_and_get_sampling_client()
    training.save_weights_and_get_sampling_client()  # the learner is at version 2
    datums = _datums(tok)
    for d, r in zip(datums, (1.0, 0.0, 0.0)):
        d.reward, d.group_id = r, 7
        d.behaviour_logprobs = [-1.0] * d.completion_len
        d.policy_versions = [1] * d.completion_len
    out = training.forward(datums, "gepo").result()
    assert out.metrics["staleness/mean"] == 1.0 and out.metrics["staleness/max"] == 1.0
    # the loss centred the rewards itself: A = (2/3, −1/3, −1/3); the same run with those advantages given agrees
    for d, a in zip(datums, (2 / 3, -1 / 3, -1 / 3)):
        d.advantage = a
    given = training.forward(datums, "gepo", {"advantage": "given"}).result()
    assert given.loss == pytest.approx(out.loss, rel=1e-5)
    datums[1].reward = None
    with pytest.raises(HeteroRLError, match="datum 1 has no reward"):
        training.forward(datums, "gepo").result()


def test_bad_input_is_a_clear_error(training, tiny_policy):
    _, tok = tiny_policy
    with pytest.raises(HeteroRLError, match="no datums"):
        training.forward([]).result()
    with pytest.raises(HeteroRLError, match="prompt_len"):
        training.forward([Datum(tokens=[3, 4], prompt_len=2)]).result()
    with pytest.raises(HeteroRLError, match="behaviour_logprobs has 1 entries"):
        training.forward([Datum(tokens=[3, 4, 5], prompt_len=1, behaviour_logprobs=[0.0])]).result()
    with pytest.raises(HeteroRLError, match="unknown loss 'nope'"):
        training.forward(_datums(tok), "nope").result()
    with pytest.raises(HeteroRLError, match="no option"):
        training.forward(_datums(tok), "grpo", {"clip": 0.1}).result()
    with pytest.raises(gepo.LossInputError, match="behaviour_logprobs"):
        training.forward(_datums(tok), "grpo").result()
    with pytest.raises(HeteroRLError, match="no gradients"):
        training.optim_step().result()
    with pytest.raises(HeteroRLError, match="no training state"):
        training.load_state("/nonexistent/state.pt").result()
