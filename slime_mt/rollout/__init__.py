"""The rollout: the turn loop, groups, rewards, environments and rollout workers, and its metrics."""
