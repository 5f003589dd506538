"""Sandboxes for trainers that drive the tools themselves (TRL's `environment_factory`,
OpenEnv, verifiers' tool environments): a task's container, opened, exec'd into, verified as
Harbor's trial verifies it, closed.

Each sandbox is a Harbor trial of its own (`pool.py`), run by an agent that hands the
environment to the trainer and waits (`agent.py`): the environment's start, its healthcheck,
the task's agent timeout and user, the verifier's settings, network phases and error policy,
result.json, and our validity rule on what it came to are all Harbor's and ours exactly as
for `run_rollouts`. All of them live on one event loop of this process (`loop.py`), so that
the sandboxes are safe to use from any thread and from inside any running event loop.
"""
