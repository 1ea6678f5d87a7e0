"""Agentic RL post-training (GRPO): multi-turn tool environments, rollouts through the decode
cache, group-relative advantages and a token-level policy loss with a KL term to a frozen
reference. The QB biases stay frozen (read-only routing) unless `rl.freeze_qb = false`."""
