"""Log-scale axes labelled in plain text: ``10⁻²`` and ``2×10⁻³``, not matplotlib's mathtext.

matplotlib labels a log axis with mathtext (``$\\mathdefault{10^{-2}}$``) and parses every distinct label with
pyparsing: about 10 ms a label on a 2-core machine, a fifth of the paper grid's figures (the benchmarks page,
issue 49). `PlainLogFormatter` gives matplotlib's own labels (which ticks, which coefficient, which exponent)
written with Unicode superscripts, which the font renders directly; a label it cannot translate is left as
matplotlib wrote it. Needs matplotlib: import this module where a figure is drawn.
"""

from __future__ import annotations

import re
from typing import Any

from matplotlib.ticker import LogFormatterSciNotation

__all__ = ["PlainLogFormatter", "plain_log_labels", "plain_text"]

_SUPERSCRIPT = str.maketrans("0123456789-−", "⁰¹²³⁴⁵⁶⁷⁸⁹⁻⁻")
_MATH = re.compile(r"\$\\mathdefault\{(?P<body>[^$]*)\}\$")
_POWER = re.compile(r"\^\{(?P<exponent>[-−]?[0-9]+)\}")


def plain_text(label: str) -> str:
    """``$\\mathdefault{2\\times10^{-3}}$`` -> ``2×10⁻³``; any other label is returned unchanged."""
    match = _MATH.fullmatch(label)
    if match is None:
        return label
    body = _POWER.sub(lambda m: m.group("exponent").translate(_SUPERSCRIPT), match.group("body"))
    body = body.replace(r"\times", "×").replace("-", "−")  # the sign left is a value's: mathtext's minus
    return label if any(c in body for c in "\\^{}$") else body


class PlainLogFormatter(LogFormatterSciNotation):
    """matplotlib's log-axis labels (`LogFormatterSciNotation`), in plain text (`plain_text()`)."""

    def __call__(self, x: float, pos: int | None = None) -> str:
        return plain_text(super().__call__(x, pos))


def plain_log_labels(ax: Any, axis: str = "y") -> None:
    """Label ``ax``'s log-scale ``axis`` (``"x"`` or ``"y"``) with `PlainLogFormatter`, major and minor ticks as
    matplotlib's log scale does (minor ticks labelled where it would label them)."""
    target = ax.yaxis if axis == "y" else ax.xaxis
    target.set_major_formatter(PlainLogFormatter(10.0))
    target.set_minor_formatter(PlainLogFormatter(10.0, labelOnlyBase=False))
