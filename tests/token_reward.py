"""Reward functions that use the facts a text cannot carry (token ids, stop reason, the problem's row)."""

FACTS = []  # what `record` was given, call by call


def digits_then_eos(prompt: str, completion: str, answer: str, *, token_ids, stop_reason) -> float:
    """1 for exactly the answer followed by the end-of-sequence token, nothing else."""
    return float(stop_reason == "eos" and completion == answer)


def record(prompt: str, completion: str, answer: str, **facts) -> float:
    FACTS.append(facts)
    return 0.0


def trl_exact(prompts, completions, answer, completion_ids=None, **kwargs):
    """TRL's convention: lists in, one float per completion out; dataset columns by keyword."""
    return [float(c == a) for c, a in zip(completions, answer)]


def trl_short(prompts, completions, **kwargs):
    return [1.0 if len(c) <= 3 else 0.0 for c in completions]


def trl_wrong_length(prompts, completions, **kwargs):
    return [0.0, 0.0]
