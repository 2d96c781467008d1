"""A reward function that fails inside rollout workers only (the learner's evaluation still works): used to
check that `heterorl train` reports a crashed worker with its log and stops the run."""

import sys


def score(prompt: str, completion: str, answer: str) -> float:
    if "rollout" in sys.argv:
        raise RuntimeError("reward service unreachable")
    return 0.0
