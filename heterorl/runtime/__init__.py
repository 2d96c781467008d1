"""The asynchronous system: the learner, the rollout worker, the staleness buffer, process launch and
the simulated execution."""
