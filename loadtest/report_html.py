"""report.html: the report's ``Content`` as one self-contained page.

Built from the data, not from report.md, so that nothing is lost in a conversion (a totals
row keeps its own class, ``<tr class="total">``). Every text is escaped; the plots are
inlined as data URIs so the file can be mailed on its own.
"""

from __future__ import annotations

import base64
from html import escape
from pathlib import Path

from loadtest.report_content import Content, Figure, Section, Table

STYLE = """
body{font-family:sans-serif;max-width:1200px;margin:auto;padding:0 12px;color:#222}
table{border-collapse:collapse;margin:8px 0}
td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:right;min-width:44px}
td:first-child,th:first-child{text-align:left}
th{background:#f3f3f3}
tr.total td{font-weight:bold;border-top:2px solid #555;background:#fafafa}
.card{display:flex;flex-wrap:wrap;gap:10px;margin:12px 0}
.figure{border:1px solid #bbb;border-radius:6px;padding:8px 14px;min-width:150px}
.figure .value{font-size:22px;font-weight:bold}
.figure .label{font-size:13px;color:#444}
.figure .hint{font-size:11px;color:#777}
.flag{display:inline-block;background:#c62828;color:#fff;font-weight:bold;padding:3px 8px;
border-radius:4px;margin:2px 8px 2px 0}
img{max-width:100%;display:block;margin:12px 0}
"""


def _figure(f: Figure) -> str:
    return (f'<div class="figure"><div class="value">{escape(f.value)}</div>'
            f'<div class="label">{escape(f.label)}</div>'
            f'<div class="hint">{escape(f.hint)}</div></div>')


def _row(cells: tuple[str, ...], tag: str = "td", cls: str = "") -> str:
    attr = f' class="{cls}"' if cls else ""
    return f"<tr{attr}>" + "".join(f"<{tag}>{escape(c)}</{tag}>" for c in cells) + "</tr>"


def html_table(t: Table) -> str:
    body = [_row(r) for r in t.rows]
    if t.total is not None:
        body.append(_row(t.total, cls="total"))
    title = f"<h3>{escape(t.title)}</h3>" if t.title else ""
    return f"{title}<table>{_row(t.header, 'th')}{''.join(body)}</table>"


def _section(s: Section) -> str:
    parts = [f"<h2>{escape(s.title)}</h2>", *[html_table(t) for t in s.tables],
             *[f"<p>{escape(p)}</p>" for p in s.text]]
    if s.items:
        parts.append("<ul>" + "".join(f"<li>{escape(i)}</li>" for i in s.items) + "</ul>")
    return "".join(parts)


def _plot(out: Path, name: str) -> str:
    path = out / name
    if not path.exists():
        return f"<p>({escape(name)} was not written)</p>"
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{escape(name)}" src="data:image/png;base64,{data}">'


def html_page(c: Content, out: Path) -> str:
    """The page, with the PNGs found in ``out`` inlined."""
    flags = "".join(f'<p><span class="flag">{escape(name)}</span>{escape(meaning)}</p>'
                    for name, meaning in c.flags)
    card = '<div class="card">' + "".join(_figure(f) for f in c.card) + "</div>"
    body = [f"<h1>{escape(c.title)}</h1>", f'<section class="summary">{flags}{card}</section>',
            *[_section(s) for s in c.sections], "<h2>Plots</h2>",
            *[_plot(out, p) for p in c.plots]]
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>Sluice load test"
            f"</title><style>{STYLE}</style></head><body>{''.join(body)}</body></html>\n")
