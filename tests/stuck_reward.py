"""A reward function that never returns inside rollout workers (the learner's evaluation still works): used to
check that `heterorl train` stops the run after task.reward_timeout_s and reports the stuck worker's log."""

import sys
import threading


def score(prompt: str, completion: str, answer: str) -> float:
    if "rollout" in sys.argv:
        threading.Event().wait()  # for ever
    return 0.0
