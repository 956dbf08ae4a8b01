"""``torchfuser bench --plot``: step time, memory and loss curves per variant in one PNG."""
from __future__ import annotations


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("torchfuser bench: --plot needs matplotlib (pip install 'torchfuser[bench]')") from None
    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    names = [r["variant"] for r in rows]
    fig, (ax_t, ax_m, ax_l) = plt.subplots(1, 3, figsize=(15, 4.2))
    ax_t.bar(names, [r["ms_per_step"] for r in rows], color="tab:blue")
    ax_t.set_ylabel("ms / step (median)")
    mem = "peak memory" if rows[0]["memory_measure"].startswith("cuda") else "saved activations"
    ax_m.bar(names, [r["peak_memory_bytes"] / 2**20 for r in rows], color="tab:orange")
    ax_m.set_ylabel(f"{mem} (MiB)")
    for ax in (ax_t, ax_m):
        ax.tick_params(axis="x", rotation=30)
    for r in rows:
        ax_l.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["variant"], alpha=0.8)
    ax_l.set_xlabel("step")
    ax_l.set_ylabel("loss")
    ax_l.legend()
    r = rows[0]
    fig.suptitle(f"torchfuser bench {r['model']} on {r['device']}: batch {r['batch']}×{r['seq']}, "
                 f"torch {r['torch']}, transformers {r['transformers']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
