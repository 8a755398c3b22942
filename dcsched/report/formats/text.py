r"""Text for the terminal: names from a bundle made safe, and the figures' short forms.

Every string that comes from a bundle or a path goes through :func:`safe_text`
before it is printed, so a name cannot restyle the output or drive the terminal.

>>> print(safe_text("[red]EVIL[/red]"), safe_text("model\x1b[2J"))
\[red]EVIL\[/red] model\x1b[2J
>>> change(100, 50), change(100, 100), change(0, 3), pct(12.345)
(' (-50.0%)', ' (=)', ' (new)', '12.3%')
"""

from __future__ import annotations

from rich.markup import escape


def printable(value: object) -> str:
    """``value`` as text with control characters shown as escapes (no markup escaping)."""
    text = str(value)
    if not text.isprintable():
        text = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)
    return text


def safe_text(value: object) -> str:
    """``value`` as text fit for the terminal: rich markup escaped, control characters shown as escapes."""
    return escape(printable(value))


def change(before: float, after: float) -> str:
    """`` (+x.x%)`` from ``before`` to ``after``; `` (=)`` when it rounds to no change."""
    if before == 0:
        return "" if after == 0 else " (new)"
    percent = round(100.0 * (after - before) / before, 1)
    return f" ({percent:+.1f}%)" if percent != 0 else " (=)"


def pct(value: float) -> str:
    return f"{value:.1f}%"
