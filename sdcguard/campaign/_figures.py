"""The campaign's figures (PNG; matplotlib, imported when drawing)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sdcguard.campaign._config import CLASSES, PROTECTIONS


def plot(result: dict, out: Path) -> list[Path]:
    """Harm per site (unprotected) and detection per site x kind (ABFT) as PNGs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    summ = result["summary"]
    if "off" in summ:
        cells = summ["off"]["per_cell"]
        sites = sorted({k.split("|")[0] for k in cells})
        frac = {c: [] for c in CLASSES}
        for s in sites:
            v = [c for k, c in cells.items() if k.split("|")[0] == s]
            for c in CLASSES:
                frac[c].append(np.mean([x[c] for x in v]))
        fig, ax = plt.subplots(figsize=(10, max(4, 0.25 * len(sites))))
        left = np.zeros(len(sites))
        for c, color in zip(CLASSES, ("tab:green", "tab:orange", "tab:red"), strict=True):
            ax.barh(range(len(sites)), frac[c], left=left, color=color, label=c)
            left += np.asarray(frac[c])
        ax.set_yticks(range(len(sites)), [s.replace("decoder/", "") for s in sites], fontsize=7)
        ax.set_xlabel("fraction of trials")
        ax.set_title("Harm of one fault, unprotected")
        ax.legend(loc="lower right")
        fig.tight_layout()
        written.append(out / "harm.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    for prot in (p for p in PROTECTIONS if p != "off"):
        if prot not in summ:
            continue
        cells = summ[prot]["per_cell"]
        sites = sorted({k.split("|")[0] for k in cells})
        kinds = sorted({k.split("|")[1] for k in cells})
        grid = np.full((len(sites), len(kinds)), np.nan)
        for k, c in cells.items():
            s, kd = k.split("|")
            grid[sites.index(s), kinds.index(kd)] = c["corrected"]
        fig, ax = plt.subplots(figsize=(6, max(4, 0.25 * len(sites))))
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(kinds)), kinds)
        ax.set_yticks(range(len(sites)), [s.replace("decoder/", "") for s in sites], fontsize=7)
        ax.set_title(f"Correction rate per site x kind ({prot})")
        fig.colorbar(im)
        fig.tight_layout()
        name = "correction_" + prot.replace("+", "_") + ".png"
        written.append(out / name)
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written
