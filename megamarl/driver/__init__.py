"""The driver (global rank 0's rollout side): ``RolloutDriver`` (engines, agents, env, orchestra,
batch preparation, logging, evaluation), the rollout schedules (``schedules``: one class per
``trainer.mode``) and the streaming machinery they use (``streaming``: event loop, episode groups,
staleness, bounded buffer, group producer)."""
