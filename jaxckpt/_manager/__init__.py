"""The manager's wing: ``CheckpointManager`` (``manager``) and its policies, each in a
module of its own: ``retention`` (which steps to keep, pure), ``lease`` (the writer lease),
``marks`` (reader marks and step pins), ``cleanup`` (take-over, deletes, retention applied,
attempts), ``hosts`` and ``hostcopy`` (per-host directories: groups, agreement, copies to
a host that lacks a step), ``tiers`` (the persistent tier and routing between tiers),
``preemption``, ``history`` and ``cadence`` (the save log and interval advice)."""
