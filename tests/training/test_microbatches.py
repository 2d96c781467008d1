"""A forward_backward in micro-batches of at most `optim.tokens_per_microbatch` tokens
(`heterorl.training.microbatches`): the model never runs on more tokens at once than the budget, and the loss,
its metrics, the log-probs and every gradient equal the whole minibatch's at once, for losses normalised over the
whole batch and per group."""

import copy
import random

import pytest
import torch

from heterorl.training import microbatches
from heterorl.training.session import Datum, TrainingClient


def test_split_keeps_a_prompts_group_together_when_it_fits_and_bounds_every_micro_batch():
    seqs = [[1] * 10, [1] * 10, [2] * 30, [3] * 8, [3] * 8, [3] * 8, [4] * 50]
    lens = [3, 3, 5, 2, 2, 2, 4]  # prompts: [1]*3 twice, [2]*5, [3]*2 three times, [4]*4
    assert microbatches.split(seqs, lens, 0) == [list(range(7))]
    batches = microbatches.split(seqs, lens, 40)
    assert batches == [[0, 1], [2], [3, 4, 5], [6]]  # the [3] group (24 tokens) stays whole, after the 30 alone
    assert microbatches.split(seqs, lens, 20)[2:] == [[3, 4], [5], [6]]  # a group over the budget is split
    assert all(sum(len(seqs[i]) for i in b) <= 40 for b in batches[:-1]) and batches[-1] == [6]  # 50 > 40 alone
    assert sorted(i for b in batches for i in b) == list(range(7))
    assert microbatches.split(seqs, lens, 1000) == [list(range(7))]


def _datums(tokenizer, seed: int = 0) -> list[Datum]:
    rng = random.Random(seed)
    datums = []
    for group in range(4):
        prompt = tokenizer.encode(f"{rng.randrange(100)}+{rng.randrange(100)}=")
        for _ in range(4):
            completion = tokenizer.encode(str(rng.randrange(1000)))
            datums.append(Datum(tokens=prompt + completion, prompt_len=len(prompt), advantage=rng.uniform(-1, 1),
                                reward=rng.random(), group_id=group, behaviour_logprobs=[-1.5] * len(completion)))
    return datums


@pytest.mark.parametrize("loss", ["grpo", "gepo", "importance_sampling"])
def test_micro_batches_give_the_whole_batchs_loss_log_probs_and_gradients(tiny_policy, loss):
    model, tokenizer = tiny_policy
    datums = _datums(tokenizer)
    outputs, grads, widest = [], [], []
    for budget in (0, 24):
        training = TrainingClient(copy.deepcopy(model), tokenizer, seed=0, tokens_per_microbatch=budget)
        seen = []
        hook = training.model.register_forward_pre_hook(
            lambda module, args, kwargs: seen.append(int(kwargs["input_ids"].numel())), with_kwargs=True)
        outputs.append(training.forward_backward(datums, loss).result())
        hook.remove()
        widest.append(max(seen))
        grads.append({n: p.grad.clone() for n, p in training.model.named_parameters() if p.grad is not None})
        training.close()
    whole, split = outputs
    assert widest[1] <= 24 < widest[0]  # the model never ran on more than the budget's tokens at once
    assert split.loss == pytest.approx(whole.loss, rel=1e-5, abs=1e-6)
    for key, value in whole.metrics.items():
        assert split.metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    for a, b in zip(whole.logprobs, split.logprobs):
        assert a == pytest.approx(b, abs=1e-5)
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        error = float((grads[1][name] - grad).norm() / grad.norm().clamp(min=1e-12))
        assert error < 1e-5, (name, error)


def test_a_loss_that_is_not_finite_leaves_the_gradients_as_they_were(tiny_policy):
    model, tokenizer = tiny_policy
    training = TrainingClient(copy.deepcopy(model), tokenizer, seed=0, tokens_per_microbatch=16)

    def exploding(batch, config):
        return (batch.logprobs * batch.mask).sum() * float("inf"), {}

    with pytest.raises(Exception, match="not finite"):
        training.forward_backward(_datums(tokenizer), exploding).result()
    assert all(p.grad is None for p in training.model.parameters())
    training.close()


def test_activation_checkpointing_gives_the_same_gradients_and_bfloat16_stays_close(tiny_policy):
    """`policy.activation_checkpointing` recomputes each layer's activations in the backward: the same loss and
    gradients. `policy.train_dtype: bfloat16` runs the forward and backward under autocast: log-probs within a
    bfloat16's precision of float32's, and the gradient pointing the same way."""
    model, tokenizer = tiny_policy
    datums = _datums(tokenizer)
    runs = {}
    for name, options in (("float32", {}), ("checkpointing", {"activation_checkpointing": True}),
                          ("bfloat16", {"train_dtype": "bfloat16"})):
        training = TrainingClient(copy.deepcopy(model), tokenizer, seed=0, **options)
        out = training.forward_backward(datums, "grpo").result()
        grad = torch.cat([p.grad.flatten() for p in training.model.parameters() if p.grad is not None])
        runs[name] = out, grad
        training.close()
    (base, base_grad), (ckpt, ckpt_grad), (bf16, bf16_grad) = runs.values()
    assert ckpt.loss == pytest.approx(base.loss, rel=1e-5) and float((ckpt_grad - base_grad).norm()) < 1e-5 * float(
        base_grad.norm())
    mismatch = max(abs(a - b) for x, y in zip(base.logprobs, bf16.logprobs) for a, b in zip(x, y))
    assert 0 < mismatch < 0.1, mismatch  # (bfloat16 has 8 bits of mantissa)
    assert float(torch.nn.functional.cosine_similarity(bf16_grad, base_grad, dim=0)) > 0.9
    with pytest.raises(Exception, match="policy.train_dtype='float16'"):
        TrainingClient(copy.deepcopy(model), tokenizer, train_dtype="float16")
