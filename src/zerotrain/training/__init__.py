"""One training run on one rank: the loop and the parts it composes (control channel, guard, invariants, metrics)."""
