"""An episode's network: the task's policy for the agent's phase, enforced by address in a
router namespace the agent's packets must cross (:mod:`.network` composes it)."""
