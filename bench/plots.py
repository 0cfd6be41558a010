"""Plot helpers for the benchmarks: figures drawn off-screen and saved alike, and side-by-side bar
panels for the end-to-end benchmarks (one bar per variant, ours highlighted)."""

from __future__ import annotations

from pathlib import Path


def subplots(*args, **kwargs):
    """``plt.subplots`` with the off-screen backend (benchmarks run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save(fig, path: Path, title: str | None = None) -> None:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def bar_panels(rows: dict[str, dict], panels: list[tuple[str, str]], title: str, path: Path,
               highlight: str = "prefix") -> None:
    """One panel per (key, label) of ``panels``: each row's value of ``key``, ``highlight`` in green."""
    names = list(rows)
    fig, axes = subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    for ax, (key, label) in zip(axes, panels, strict=True):
        ax.bar(names, [rows[n][key] for n in names], color=["tab:green" if n == highlight else "tab:gray" for n in names])
        ax.set_title(label)
    save(fig, path, title)
