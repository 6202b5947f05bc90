"""The export bundle's ``loss.png``: training loss per optimizer step (optional: needs matplotlib)."""

from __future__ import annotations

import io
import logging

log = logging.getLogger("trainproof.export")


def loss_png(steps: list[int], losses: list[float], title: str) -> bytes | None:
    """A PNG of ``losses`` against ``steps`` (log-scaled when the loss spans more than a decade); None without
    matplotlib (the bundle is complete without it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display in a container or a test
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib is not installed: the export bundle has no loss.png")
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, color="tab:blue", linewidth=1.2, marker="o" if len(steps) <= 40 else None, markersize=3)
    positive = [v for v in losses if v > 0]
    if positive and max(positive) > 10 * min(positive):
        ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (step mean)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    buf = io.BytesIO()
    # No timestamp in the PNG: the same history gives the same bytes (the bundle is checksummed).
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()
