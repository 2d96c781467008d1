"""Prompts are encoded with the tokenizer's own special-token rule, the same way everywhere a prompt is encoded."""

import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from heterorl.config import load_config
from heterorl.errors import SamplingError
from heterorl.loops.sft import demonstration_datums
from heterorl.loops.sync_rl import rollout_datums
from heterorl.policies import load_policy
from heterorl.rollout.textcodec import encode_prompt
from heterorl.tasks.arithmetic import ArithmeticConfig, ArithmeticTask
from heterorl.training.evaluation import evaluate
from heterorl.training.session import TrainingClient

TASK = ArithmeticTask(ArithmeticConfig(digits=2, eval_size=4, answer_format="digits"))


def char_tokenizer(single: str = "<bos> $A") -> PreTrainedTokenizerFast:
    """A `tokenizers` char-level tokenizer over the task's alphabet with a post-processor (a BOS in front by
    default), as a TRL user builds one."""
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2}
    for char in TASK.alphabet():
        vocab.setdefault(char, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("<bos>", 1), ("<eos>", 2)])
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


@pytest.fixture(scope="module")
def bos_policy(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bos-policy")
    tokenizer = char_tokenizer()
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                                 pad_token_id=0)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return load_policy(str(folder))


class RecordingSampler:
    """A sampling client that records the prompts it was given."""

    def __init__(self, sampler):
        self.inner, self.tokenizer, self.version, self.prompts = sampler, sampler.tokenizer, sampler.version, []

    def sample(self, prompts, n, params):
        self.prompts += [list(p) for p in prompts]
        return self.inner.sample(prompts, n, params)


def test_a_bos_post_processor_starts_every_prompt_in_sft_sampling_and_evaluation(bos_policy):
    model, tokenizer = bos_policy
    problem = TASK.eval_problems()[0]
    expected = [tokenizer.bos_token_id] + tokenizer(problem.prompt, add_special_tokens=False).input_ids
    assert encode_prompt(tokenizer, problem.prompt) == expected
    training = TrainingClient(model, tokenizer)
    sft = demonstration_datums(TASK, tokenizer, random.Random(0), 4)
    assert all(d.tokens[0] == tokenizer.bos_token_id and d.tokens[-1] == tokenizer.eos_token_id for d in sft)
    sampler = RecordingSampler(training.save_weights_and_get_sampling_client())
    cfg = load_config(None, ["rollout.group_size=2", "rollout.max_tokens=3"])
    datums, _ = rollout_datums(sampler, TASK, [problem], cfg, seed=0)
    assert all(d.tokens[:d.prompt_len] == expected for d in datums)  # what the learner trains on
    evaluate(sampler, TASK, [problem], max_tokens=3)
    assert sampler.prompts == [expected, expected]  # rollouts, then evaluation


def test_an_end_of_sequence_a_template_appends_is_left_out_of_a_prompt():
    tokenizer = char_tokenizer("<bos> $A <eos>")
    ids = encode_prompt(tokenizer, "12+3=")
    assert ids[0] == 1 and 2 not in ids and len(ids) == 6
    assert encode_prompt(char_tokenizer("$A"), "12+3=") == ids[1:]  # no rule: the text's tokens only


def test_an_empty_or_unrepresentable_prompt_is_an_error():
    with pytest.raises(SamplingError, match="prompt is empty"):
        encode_prompt(char_tokenizer(), "")
    with pytest.raises(SamplingError, match="cannot represent prompt"):
        encode_prompt(char_tokenizer(), "12+x=")


def test_a_policy_that_solves_nothing_at_step_0_is_warned_about(caplog):
    from heterorl.runs import StepRecorder

    cfg = load_config(None, ["rl.steps=2", "rl.eval_every=1"])
    for success, warned in ((0.0, True), (0.25, False)):
        caplog.clear()
        StepRecorder(cfg, lambda: success).start()
        assert ("solves none of the held-out problems" in caplog.text and "BOS token" in caplog.text) == warned


def test_a_chat_template_renders_every_prompt_when_the_task_asks(bos_policy):
    model, tokenizer = bos_policy
    template = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}#{% endif %}")
    problem = TASK.eval_problems()[0]
    with pytest.raises(SamplingError, match="task.chat_template is true but this policy's tokenizer .* has no chat "
                                            "template"):
        encode_prompt(tokenizer, problem.prompt, chat_template=True)
    tokenizer.chat_template = template
    try:
        expected = encode_prompt(tokenizer, problem.prompt) + tokenizer("#", add_special_tokens=False).input_ids
        assert encode_prompt(tokenizer, problem.prompt, chat_template=True) == expected  # one BOS, then '#'
        sampler = RecordingSampler(TrainingClient(model, tokenizer).save_weights_and_get_sampling_client())
        cfg = load_config(None, ["rollout.group_size=2", "rollout.max_tokens=3", "task.chat_template=true"])
        datums, _ = rollout_datums(sampler, TASK, [problem], cfg, seed=0)
        evaluate(sampler, TASK, [problem], max_tokens=3, chat_template=True)
        assert sampler.prompts == [expected, expected] and datums[0].tokens[:datums[0].prompt_len] == expected
        sft = demonstration_datums(TASK, tokenizer, random.Random(0), 2, chat_template=True)
        assert all(d.tokens[d.prompt_len - 1] == expected[-1] for d in sft)  # the assistant's turn opened
    finally:
        tokenizer.chat_template = None
