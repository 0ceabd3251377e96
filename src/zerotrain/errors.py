"""The error zerotrain raises for a failure it detected and can explain in one line."""


class ZeroTrainError(RuntimeError):
    """A failure zerotrain detected and can explain in one line (an invariant, a bad checkpoint...)."""
