"""What the report's markdown and plots (prorag_app.report) and its HTML page (prorag_app.report_html) share: the
hop-count columns, how a fraction is shown, and a figure as inline SVG. Both import this; neither imports the
other for it.
"""

from __future__ import annotations

import io

#: the hop counts every per-hop table and plot of the report has a column for
HOP_GROUPS = ("1", "2", "3", "4")


def pct(v: float | None) -> str:
    """A fraction as a percentage with one decimal ("-" when there is none)."""
    return "-" if v is None else f"{100 * v:.1f}"


def svg_of(fig) -> str:
    """A matplotlib figure as an inline <svg> element: text kept as text, ids fixed by a salt so a page is
    reproducible (matplotlib derives them from the content, so two figures' ids only meet where they are equal)."""
    import matplotlib  # heavy; only a report with plots needs it

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "prorag-report"}):
        fig.savefig(buf, format="svg")
    text = buf.getvalue()
    return text[text.index("<svg"):]


__all__ = ["HOP_GROUPS", "pct", "svg_of"]
