"""``torchfuser bench --plot``: step times (median and every step), memory and loss curves per variant in one PNG."""
from __future__ import annotations

import math

from torchfuser.cli import CLIError

_NEEDS = "--plot needs matplotlib (pip install 'torchfuser[bench]')"


def check_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CLIError(_NEEDS) from None


def figure(rows: list[dict]):
    """The figure ``plot`` saves: (step times, memory, losses) axes, for a test to read without pixels."""
    check_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    names = [r["variant"] for r in rows]
    x = range(len(rows))
    fig, (ax_t, ax_m, ax_l) = plt.subplots(1, 3, figsize=(15, 4.2))

    # Step times: the median as a bar, every step as a point (the spread a median hides), warm-up hollow.
    ax_t.bar(x, [r["ms_per_step"] for r in rows], color="tab:blue", alpha=0.35, label="median")
    for i, r in enumerate(rows):
        steps, skip = r["step_ms"], r["warmup_steps"]
        spread = [i + 0.3 * (k / max(len(steps) - 1, 1) - 0.5) for k in range(len(steps))]  # side by side, in step order
        ax_t.scatter(spread[skip:], steps[skip:], s=14, color="tab:blue", zorder=3,
                     label="each step" if i == 0 else None)
        if skip:
            ax_t.scatter(spread[:skip], steps[:skip], s=14, facecolors="none", edgecolors="gray", zorder=3,
                         label="warm-up (not counted)" if i == 0 else None)
    ax_t.set_ylabel("ms / step")
    ax_t.set_ylim(bottom=0)
    ax_t.legend(fontsize="small")

    peak = any(r["peak_memory_bytes"] is not None for r in rows)
    key, what = ("peak_memory_bytes", "peak memory") if peak else ("saved_activation_bytes", "saved activations")
    ax_m.bar(x, [math.nan if r[key] is None else r[key] / 2**20 for r in rows], color="tab:orange")
    ax_m.set_ylabel(f"{what} (MiB)")
    for ax in (ax_t, ax_m):
        ax.set_xticks(list(x), names, rotation=30, ha="right")

    # Losses: the reference (eager) drawn last, dashed with its own markers, so a variant that matches it
    # exactly shows both lines instead of hiding one under the other.
    ref = rows[0]["loss_reference"]
    ordered = [r for r in rows if r["variant"] != ref] + [r for r in rows if r["variant"] == ref]
    markers = "osD^v<>p"
    for k, r in enumerate(ordered):
        steps = range(1, len(r["losses"]) + 1)
        if r["variant"] == ref:
            ax_l.plot(steps, r["losses"], label=r["variant"], color="black", linestyle="--", marker="x",
                      markersize=6, linewidth=1.2, zorder=4)
        else:
            ax_l.plot(steps, r["losses"], label=r["variant"], marker=markers[k % len(markers)], markersize=5,
                      linewidth=2.5, alpha=0.7, zorder=2)
    ax_l.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax_l.set_xlabel("step")
    ax_l.set_ylabel("loss")
    ax_l.legend(fontsize="small")
    r = rows[0]
    fig.suptitle(f"torchfuser bench {r['model']} on {r['device']}: batch {r['batch']}×{r['seq']}, "
                 f"torch {r['torch']}, transformers {r['transformers']}")
    fig.tight_layout()
    return fig


def plot(rows: list[dict], path: str) -> None:
    fig = figure(rows)
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
