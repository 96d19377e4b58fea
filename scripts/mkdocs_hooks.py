"""MkDocs hook (``mkdocs.yml``: ``hooks``): table cells that read right on the forge read right on the site too.

A pipe inside a code span in a Markdown table is written ``\\|`` (GitHub's tables need the escape and drop it);
Python-Markdown's tables keep the backslash inside code. Here such a code span becomes ``<code>`` with the
pipe as ``&#124;``, which both render alike, before the page is converted.
"""

from __future__ import annotations

import html
import re

_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)")


def _cell_code(match: re.Match) -> str:
    text = match.group(2)
    if "\\|" not in text:
        return match.group(0)
    text = text.strip() if text.startswith(" ") and text.endswith(" ") else text
    return "<code>" + html.escape(text.replace("\\|", "|"), quote=False).replace("|", "&#124;") + "</code>"


def on_page_markdown(markdown: str, **kwargs) -> str:
    out, fenced = [], False
    for line in markdown.split("\n"):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        if not fenced and line.lstrip().startswith("|"):
            line = _SPAN.sub(_cell_code, line)
        out.append(line)
    return "\n".join(out)
