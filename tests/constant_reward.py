"""A reward function that scores every completion 0: every group is uniform, so no step has a learning signal."""


def score(prompt: str, completion: str, answer: str) -> float:
    return 0.0
