"""tinker-cookbook environments that run offline, as sources of task ``cookbook_env``.

The cookbook's envs need a renderer, and a renderer a tokenizer; there is no model hub here, so the tokenizer is
made in code: one token per byte (GPT-2's byte alphabet) plus Llama 3's four special tokens, registered with the
cookbook as `TOKENIZER_NAME` so that its own dataset builders (``get_tokenizer(model_name)``; guess-the-number's,
say) find it. The envs and builders here are the cookbook's: twenty questions (its answerer, a model in the
recipe, is a rule here: "yes" when the question names the secret word; `Tidy` records its cleanups), arithmetic
(``ProblemEnv``) and pairwise preference.
"""

from __future__ import annotations

import functools
import re

from tinker_cookbook.completers import MessageCompleter
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDataset
from tinker_cookbook.recipes.multiplayer_rl.twenty_questions.env import TwentyQuestionsEnvGroupBuilder
from tinker_cookbook.renderers import get_renderer, get_text_content
from tinker_cookbook.rl.preference_envs import PairwisePreferenceGroupBuilder, TournamentPattern
from tinker_cookbook.tokenizer_utils import register_tokenizer

TOKENIZER_NAME = "heterorl-tests/bytes-llama3"
SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


@functools.cache
def byte_tokenizer():
    """A Hugging Face fast tokenizer: one id per byte (0-255; BPE without merges), then `SPECIALS` (256-259); its
    end-of-sequence token is ``<|eot_id|>``, which ends a Llama 3 turn."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=SPECIALS[0], eos_token=SPECIALS[3],
                                   additional_special_tokens=SPECIALS[1:3])


register_tokenizer(TOKENIZER_NAME, byte_tokenizer)


def renderer(name: str = "llama3"):
    return get_renderer(name, byte_tokenizer(), model_name=TOKENIZER_NAME)


class RuleAnswerer(MessageCompleter):
    """The answerer of twenty questions: "yes" when the player's last turn names the secret word, else "no"."""

    async def __call__(self, messages):
        secret = re.search(r"Your secret word is (\w+)", get_text_content(messages[0])).group(1)
        question = get_text_content(messages[-1]).lower()
        return {"role": "assistant", "content": "yes" if secret.lower() in question else "no"}


def twenty_questions(answers=("cat", "dog", "sun", "car", "map", "pen"), group_size: int = 2,
                     renderer_name: str = "llama3") -> list:
    """One cookbook twenty-questions group per secret word."""
    return [TwentyQuestionsEnvGroupBuilder(answerer=RuleAnswerer(), answer=answer, renderer=renderer(renderer_name),
                                           num_envs=group_size) for answer in answers]


CLEANED_UP: list[str] = []  # the answers of the groups `Tidy.cleanup` ran for, in order


class Tidy(TwentyQuestionsEnvGroupBuilder):
    """Twenty questions whose cleanup is recorded in `CLEANED_UP`."""

    async def cleanup(self) -> None:
        CLEANED_UP.append(self.answer)


def tidy_twenty_questions(answers=("cat", "dog", "sun")) -> list:
    return [Tidy(answerer=RuleAnswerer(), answer=answer, renderer=renderer(), num_envs=2) for answer in answers]


def arithmetic(n_batches: int = 3, batch_size: int = 2, group_size: int = 2) -> ArithmeticDataset:
    """The cookbook's addition problems (a ``ProblemGroupBuilder`` each), its few-shot prefix included."""
    return ArithmeticDataset(batch_size=batch_size, renderer=renderer(), group_size=group_size, n_batches=n_batches)


def pairwise(group_size: int = 2) -> list:
    """Groups scored by comparing their completions (``compute_group_rewards``); the preference model is never
    called here."""
    return [PairwisePreferenceGroupBuilder(convo_prefix=[{"role": "user", "content": "Write a haiku."}],
                                           policy_renderer=renderer(),
                                           tournament_pattern=TournamentPattern.ALL_PAIRS_BOTH_WAYS,
                                           preference_model=None, num_envs=group_size)]
