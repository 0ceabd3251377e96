"""Headless matplotlib for every figure zerotrain draws (plot, bench accum, bench compare), or one line naming the extra."""

from __future__ import annotations

from zerotrain.errors import ConfigError


def pyplot(what: str):
    """matplotlib.pyplot on the Agg backend (files only, no display); `what` names the figure for the error."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(f"{what} needs matplotlib: pip install 'zerotrain[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
