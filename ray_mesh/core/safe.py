"""Text from storage or the network, made safe to print: the one helper every printout uses.

A run name, a node's IP, a metric label, a file name in a checkpoint directory, a marker's
content, a thread name in a hang report: ray_mesh prints all of them, and none was written
by the person reading. A terminal obeys escape sequences (``ESC[2J`` clears the screen,
``ESC]8;;`` makes links, ``\\r`` rewrites a line so a message reads differently); a lone
surrogate from undecodable bytes makes ``print`` itself raise; bidirectional overrides make
text read in another order than it is. :func:`safe_text` writes every such character as a
visible escape (``\\x1b``, ``\\r``, ``\\u202e``) and cuts text that is too long, so a
printout shows what was there, on the lines it meant, and never crashes or rewrites the
terminal. It is idempotent (backslashes are left alone), so text escaped at the boundary can
be escaped again where it is printed.
"""

from __future__ import annotations

import re
from typing import Any

# C0 controls, DEL and C1 controls; Unicode format characters that reorder or hide text
# (ALM, zero-width and directional marks, LRE..RLO, word joiner, LRI..PDI, BOM); the line
# and paragraph separators; lone surrogates (str decoded with errors="surrogateescape").
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069"
                     "\ufeff\ud800-\udfff]")
_UNSAFE_KEEP_LINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f"
                                "\u2028-\u202e\u2060-\u2069\ufeff\ud800-\udfff]")
NAME_LIMIT = 200
"""Characters kept of a name (run, node, interface, label) before it is cut."""


_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(m: re.Match[str]) -> str:
    char = m.group()
    if char in _SHORT:
        return _SHORT[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def safe_text(value: Any, limit: int | None = None, *, multiline: bool = False) -> str:
    """``value`` as text with control characters escaped, cut after ``limit`` characters.

    ``multiline`` keeps newlines and tabs (for a report of several lines built by ray_mesh
    itself); otherwise they are escaped too, so one field can never start a line of its own.
    A cut says how much was left out: ``abc…(+9000 chars)``.
    """
    text = value if isinstance(value, str) else str(value)
    extra = ""
    if limit is not None and len(text) > limit:
        extra = f"…(+{len(text) - limit} chars)"
        text = text[:limit]
    pattern = _UNSAFE_KEEP_LINES if multiline else _UNSAFE
    return pattern.sub(_escape, text) + extra


def clip(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters (its end then ``...``): for a field a
    bounded reader takes, which :func:`safe_text`'s ``…(+N chars)`` would overrun."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def has_control(value: str) -> bool:
    """Whether :func:`safe_text` would escape something in ``value``."""
    return _UNSAFE.search(value) is not None
