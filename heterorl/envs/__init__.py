"""Multi-turn environments: the policy writes, the environment answers, the learner trains only the policy's
tokens (docs/ENVIRONMENTS.md).

``base`` holds the environment contract (`Environment`, `StepResult`, `EpisodeTask`), ``spans`` the rule that
marks the environment's tokens inside a completion, ``episodes`` the runner that plays a batch of episodes with a
sampling engine. The shipped environments (``maze_walk``, ``calculator``) and the adapters to other libraries'
environments live beside them. This module imports nothing, so the transport's codec can use ``spans``.
"""
