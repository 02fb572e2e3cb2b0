"""The manager's wing: ``CheckpointManager`` and its policies."""
