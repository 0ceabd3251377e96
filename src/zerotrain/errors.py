"""The error types every part of zerotrain raises; the CLI turns each into one line."""


class ZeroTrainError(RuntimeError):
    """A failure zerotrain detected and can explain in one line (an invariant, a bad checkpoint...)."""


class ConfigError(ValueError):
    """A configuration the user can fix; the CLI prints it as one line and exits 2."""


class CheckpointError(ZeroTrainError):
    """A checkpoint that is missing, incomplete, or fails verification."""


class InvariantError(ZeroTrainError):
    """A correctness invariant failed: a non-finite loss, drift between replicas, wrong optimizer memory."""
