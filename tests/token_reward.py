"""Reward functions that use the facts a text cannot carry (token ids, stop reason, the problem's row)."""

FACTS = []  # what `record` was given, call by call


def digits_then_eos(prompt: str, completion: str, answer: str, *, token_ids, stop_reason) -> float:
    """1 for exactly the answer followed by the end-of-sequence token, nothing else."""
    return float(stop_reason == "eos" and completion == answer)


def record(prompt: str, completion: str, answer: str, **facts) -> float:
    FACTS.append(facts)
    return 0.0
