"""Prefix reuse in the torch engine: a prompt that extends a context generated from earlier prefills only its new
tokens, with the kept keys and values, and samples exactly as a whole prefill does."""

import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from heterorl.engines import SamplingParams, TorchEngine
from heterorl.engines.base import SamplingEngine, WeightUpdates
from heterorl.engines.prefix_cache import PrefixStore
from heterorl.rollout.episodes import EpisodeLimits, rollout_groups
from heterorl.training.session import SamplingClient
from tests.conftest import perturbed_state, teacher_forced
from tests.rollout.test_episodes import Toy


def _first_turn(engine, tok, seed=5):
    """Three prompts of different lengths, one turn each with reuse; the turns end at different lengths, one of
    them early (EOS or a stop token) while the others go on."""
    prompts = [tok("S.#\n..G\n>")["input_ids"], tok("S.\n.G\n>R")["input_ids"], tok(">")["input_ids"]]
    stop = tuple(tok.convert_tokens_to_ids(c) for c in "UD")
    params = SamplingParams(max_tokens=8, seed=seed, stop_token_ids=stop)
    turns = [g[0].tokens for g in engine.generate(prompts, params, reuse_prefixes=True)]
    lengths = [len(t) for t in turns]
    assert len(set(lengths)) == 3 and min(lengths) < 8 == max(lengths)  # the cases this file is about
    return prompts, turns


def _contexts(tok, prompts, turns, observation="\n1>"):
    return [p + t + tok(observation)["input_ids"] for p, t in zip(prompts, turns)]


def _count_forward_tokens(model) -> list:
    """Replace ``model.forward`` with one that records the shape of each call's input ids."""
    shapes, forward = [], model.forward

    def counted(*args, **kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))
        return forward(*args, **kwargs)

    model.forward = counted
    return shapes


@pytest.mark.parametrize("num_samples", [1, 3])
def test_a_later_turn_samples_as_a_whole_prefill_does_and_as_teacher_forcing_says(tiny_policy, num_samples):
    """Rows of different lengths hit kept contexts of different lengths, one row misses (a new prompt), one
    kept context comes from a row that stopped early; same tokens and log-probs as a fresh engine's."""
    model, tok = tiny_policy
    engine = TorchEngine(copy.deepcopy(model), tok)
    prompts, turns = _first_turn(engine, tok)
    contexts = _contexts(tok, prompts, turns) + [tok("S#G\n.>")["input_ids"]]
    params = SamplingParams(max_tokens=6, seed=11)
    reused = engine.generate(contexts, params, num_samples, reuse_prefixes=True)
    whole = TorchEngine(copy.deepcopy(model), tok).generate(contexts, params, num_samples)
    for context, group_reused, group_whole in zip(contexts, reused, whole):
        for a, b in zip(group_reused, group_whole):
            assert a.tokens == b.tokens and a.stop_reason == b.stop_reason
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
            exact = teacher_forced(model, context, a.tokens)
            assert (exact - torch.tensor(a.logprobs)).abs().max() <= 1e-4


def test_a_later_turn_prefills_only_its_new_tokens(tiny_policy):
    model, tok = tiny_policy
    engine = TorchEngine(copy.deepcopy(model), tok)
    prompts, turns = _first_turn(engine, tok)
    contexts = _contexts(tok, prompts, turns)
    shapes = _count_forward_tokens(engine.model)
    engine.generate(contexts, SamplingParams(max_tokens=1, seed=0), reuse_prefixes=True)
    # each row's new tokens: its last turn's final token (never fed to the model) and the 3-token answer
    assert shapes == [(3, 1 + 3)]
    shapes.clear()
    engine.generate(contexts, SamplingParams(max_tokens=1, seed=0))
    assert shapes == [(3, max(map(len, contexts)))]  # without reuse: every context whole


def test_new_weights_empty_the_store(tiny_policy):
    """After load_state_dict a kept context would hold the old weights' keys: the next turn must follow the new
    weights, which differ enough that the old keys would show."""
    model, tok = tiny_policy
    engine = TorchEngine(copy.deepcopy(model), tok)
    prompts, turns = _first_turn(engine, tok)
    new_model = copy.deepcopy(model)
    new_model.load_state_dict(perturbed_state(model, 0))
    engine.load_state_dict(new_model.state_dict())
    assert len(engine.prefixes) == 0
    contexts = _contexts(tok, prompts, turns)
    out = engine.generate(contexts, SamplingParams(max_tokens=6, seed=2), reuse_prefixes=True)
    moved = 0.0
    for context, (sample,) in zip(contexts, out):
        logprobs = torch.tensor(sample.logprobs)
        assert (teacher_forced(new_model, context, sample.tokens) - logprobs).abs().max() <= 1e-4
        moved = max(moved, (teacher_forced(model, context, sample.tokens) - logprobs).abs().max().item())
    assert moved > 1e-2

    class Adapter(dict):
        adapter = True

    engine.adapter_loader = lambda state: None
    engine.generate(contexts, SamplingParams(max_tokens=2, seed=2), reuse_prefixes=True)
    assert len(engine.prefixes) > 0
    engine.load_state_dict(Adapter())
    assert len(engine.prefixes) == 0


def test_contexts_kept_after_an_inflight_update_are_the_new_weights(tiny_policy):
    model, tok = tiny_policy
    new_model = copy.deepcopy(model)
    new_model.load_state_dict(perturbed_state(model, 1))
    engine = TorchEngine(copy.deepcopy(model), tok)
    _first_turn(engine, tok)
    polls = iter([None, None, (1, new_model.state_dict())])
    prompts = [tok("S.G\n>")["input_ids"], tok("S#\n.G\n>")["input_ids"]]
    first = engine.generate(prompts, SamplingParams(max_tokens=6, seed=3, ignore_eos=True), reuse_prefixes=True,
                            updates=WeightUpdates(0, lambda: next(polls, None)))
    assert [s.versions for (s,) in first] == [[0, 0, 0, 1, 1, 1]] * 2
    assert len(engine.prefixes) == 2  # the first turn's contexts went with the old weights; these were kept
    contexts = _contexts(tok, prompts, [s.tokens for (s,) in first])
    for context, (sample,) in zip(contexts, engine.generate(contexts, SamplingParams(max_tokens=6, seed=4),
                                                            reuse_prefixes=True)):
        assert (teacher_forced(new_model, context, sample.tokens) - torch.tensor(sample.logprobs)).abs().max() <= 1e-4


def test_weights_changed_in_place_empty_the_store(tiny_policy):
    """A sampler over the training model itself (`live_sampling_client`) sees an optimizer's step without a
    load: the version counters it bumps empty the store."""
    model, tok = tiny_policy
    shared = copy.deepcopy(model)
    engine = TorchEngine(shared, tok)
    prompts, turns = _first_turn(engine, tok)
    optimizer = torch.optim.AdamW(shared.parameters(), lr=0.05)
    shared(torch.tensor([prompts[0]])).logits.logsumexp(-1).sum().backward()
    optimizer.step()
    shared.eval()
    contexts = _contexts(tok, prompts, turns)
    for context, (sample,) in zip(contexts, engine.generate(contexts, SamplingParams(max_tokens=6, seed=2),
                                                            reuse_prefixes=True)):
        assert (teacher_forced(shared, context, sample.tokens) - torch.tensor(sample.logprobs)).abs().max() <= 1e-4
        assert (teacher_forced(model, context, sample.tokens) - torch.tensor(sample.logprobs)).abs().max() > 1e-3


def test_the_store_stays_within_its_budget_and_evicts_the_least_recently_used():
    kv = lambda n: torch.zeros((2, 2, 1, n, 4))  # noqa: E731  (64 bytes a position)
    store = PrefixStore(budget_bytes=10 * 64)
    store.put((1, 2, 3), kv(3))
    store.put((1, 2, 3, 4, 5), kv(5))
    store.put((7,), kv(1))
    assert store.nbytes == 9 * 64
    assert store.longest_prefix((1, 2, 3, 4, 5, 6)).shape[3] == 5  # the longest kept prefix
    assert store.longest_prefix((1, 2, 3, 4, 5)).shape[3] == 3  # a strict prefix: one token is left to prefill
    assert store.longest_prefix((1, 2)) is None
    store.put((8, 8), kv(2))  # 11 > 10: the least recently used, (7,), goes
    assert (7,) not in store and len(store) == 3 and store.nbytes == 10 * 64
    store.put((9, 9, 9, 9), kv(4))  # then (1, 2, 3, 4, 5): (1, 2, 3) was used after it
    assert (1, 2, 3, 4, 5) not in store and (1, 2, 3) in store and store.nbytes == 9 * 64
    store.put(tuple(range(11)), kv(11))  # larger than the whole budget: not kept, nothing evicted for it
    assert len(store) == 3 and store.nbytes == 9 * 64
    assert store.longest_prefix((1, 2, 3, 4, 5, 6)).shape[3] == 3


def test_an_engine_keeps_no_more_than_its_budget(tiny_policy):
    model, tok = tiny_policy
    config = model.config  # bytes of one stored token-position: layers x (keys, values) x heads x head_dim x fp32
    head_dim = config.hidden_size // config.num_attention_heads
    per_position = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4
    engine = TorchEngine(copy.deepcopy(model), tok, prefix_cache_bytes=40 * per_position)
    prompts, turns = _first_turn(engine, tok)
    first_kept = tuple(prompts[-1] + turns[-1][:-1])
    assert first_kept in engine.prefixes
    for turn in range(3):
        contexts = _contexts(tok, prompts, turns, f"\n{turn}>")
        out = engine.generate(contexts, SamplingParams(max_tokens=4, seed=turn, ignore_eos=True), reuse_prefixes=True)
        prompts, turns = contexts, [s.tokens for (s,) in out]
        assert 0 < engine.prefixes.nbytes <= 40 * per_position
        assert tuple(prompts[-1] + turns[-1][:-1]) in engine.prefixes  # the last kept stays
    assert first_kept not in engine.prefixes  # the oldest went


def test_a_sliding_window_model_is_prefilled_whole(tiny_policy):
    _, tok = tiny_policy
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         use_sliding_window=True, sliding_window=4, max_window_layers=0, pad_token_id=0)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    engine = TorchEngine(model, tok)
    prompt = tok("S.#\n..G\n>")["input_ids"]
    [[first]] = engine.generate([prompt], SamplingParams(max_tokens=4, seed=0, ignore_eos=True), reuse_prefixes=True)
    assert len(engine.prefixes) == 0  # its cache keeps only a window: nothing to reuse
    context = prompt + first.tokens + tok("\n1>")["input_ids"]
    [[again]] = engine.generate([context], SamplingParams(max_tokens=4, seed=1), reuse_prefixes=True)
    [[whole]] = TorchEngine(model, tok).generate([context], SamplingParams(max_tokens=4, seed=1))
    assert again.tokens == whole.tokens and again.logprobs == whole.logprobs


def test_episodes_with_and_without_reuse_are_the_same(tiny_policy):
    model, tok = tiny_policy
    task = Toy()
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=7)
    played = []
    for reuse in (True, False):
        sampler = SamplingClient.for_model(copy.deepcopy(model), tok, version=0)
        sampler.engine.supports_prefix_reuse = reuse
        shapes = _count_forward_tokens(sampler.engine.model)
        played.append((rollout_groups(sampler, task, task.eval_problems(), 4, params,
                                      limits=EpisodeLimits(max_turns=8))[1], shapes))
    (reused, reused_shapes), (whole, whole_shapes) = played
    for a, b in zip(sum(reused, []), sum(whole, [])):
        assert a.tokens == b.tokens and a.env_spans == b.env_spans and a.reward == b.reward
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    prefilled = lambda shapes: sum(b * n for b, n in shapes if n > 1)  # noqa: E731 (decode steps feed 1 token)
    assert prefilled(reused_shapes) < prefilled(whole_shapes) / 2


def test_a_sampler_over_an_engine_without_reuse_ignores_it(tiny_policy):
    class Plain(SamplingEngine):
        def generate(self, prompts, params, num_samples=1):
            return [[] for _ in prompts]

        def compute_logprobs(self, sequences):
            return []

        def load_state_dict(self, state_dict):
            pass

    sampler = SamplingClient(Plain(), tiny_policy[1])
    assert sampler.sample([[1, 2]], reuse_prefixes=True).result() == [[]]
