"""What every section's plot shares: matplotlib, imported only when a plot is
drawn (without it the plot is skipped with a message), and saving a figure."""


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a message) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("reproduce: matplotlib is missing (Debian: python3-matplotlib); the plot is skipped")
        return None
    return plt


def save(plt, fig, png, dpi=80, tight_layout=True, **savefig):
    """Writes the figure to PNG and closes it; True (the plot was written)."""
    if tight_layout:
        fig.tight_layout()
    fig.savefig(png, dpi=dpi, **savefig)
    plt.close(fig)
    return True
