"""``report.html``: the report as one self-contained page.

The page is built from what the report already wrote, so every table and figure the report gains later appears
in it without a change here:

* ``report.md``'s blocks in order: each pipe table becomes an HTML ``<table>`` with a ``<caption>`` (the
  heading it sits under) and an ``id`` (``table-`` and that heading as a slug, made unique), each figure
  (``![alt](file)``) an ``<img>`` whose source is the figure file as a base64 ``data:`` URI (its PNG, else its
  SVG; a figure written only as PDF is named, not embedded), headings, paragraphs and lists as such;
* the run settings: per (protocol, backbone, method) the datasets, shots and seeds; the conventions of
  ``report.json`` (confidence intervals, averages, cost); per method its runs' ``config.yaml``, the keys all
  its runs share with their value and the keys that vary with their values.

Nothing on the page is fetched: no script, no web font, no stylesheet or image from anywhere but the page, and
a Content-Security-Policy that lets the browser load nothing else. Every string from the runs (method, dataset
and backbone names, config values) is HTML-escaped.
"""
from __future__ import annotations

import base64
import html
import json
import logging
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from fewclip.report.runs import RunResult
from fewclip.utils.io import atomic_write_text

logger = logging.getLogger(__name__)

HTML_FILE = "report.html"
CONFIG_FILE = "config.yaml"
# The browser may load nothing but the page's own inline style and its data: images.
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
_MIME = {".png": "image/png", ".svg": "image/svg+xml"}
# libyaml's safe loader and dumper where PyYAML was built with it (ten times faster over thousands of runs).
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
_SHOWN_VALUES = 8  # a varying config key lists this many of its values, then how many more

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 80em; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-variant-numeric: tabular-nums; }
caption { caption-side: top; text-align: left; color: #555; font-size: 0.9em; padding: 0.3em 0; }
th, td { border-bottom: 1px solid #ddd; padding: 0.25em 0.7em; text-align: left; vertical-align: top; }
th { border-bottom: 2px solid #888; }
td.num, th.num { text-align: right; }
figure { margin: 1em 0; } figure img { max-width: 100%; height: auto; }
figcaption { color: #555; font-size: 0.9em; }
code { background: #f3f3f3; padding: 0 0.2em; }
details { margin: 0.5em 0; } summary { cursor: pointer; }
dt { font-weight: 600; } dd { margin: 0 0 0.5em 1.5em; }
.missing { color: #a00; }
"""


def esc(text: Any) -> str:
    """``text`` as HTML text or attribute value (quotes escaped too)."""
    return html.escape(str(text), quote=True)


# ----------------------------------------------------------------------------
# The subset of Markdown the report writes


_HEADING = re.compile(r"^(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
_RULE = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")
_IMAGE = re.compile(r"^!\[([^\]]*)\]\(([^)\s]+)\)$")
_INLINE = re.compile(r"`([^`]*)`|\*\*(.+?)\*\*|\[([^\]]+)\]\(([^)\s]+)\)")
_CELL_SPLIT = re.compile(r"(?<!\\)\|")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def inline(text: str) -> str:
    """Markdown inline text (``code``, **bold**, [link](target)) as HTML, everything else escaped."""
    out, pos = [], 0
    for m in _INLINE.finditer(text):
        out.append(esc(text[pos:m.start()]))
        code, bold, label, target = m.groups()
        if code is not None:
            out.append(f"<code>{esc(code)}</code>")
        elif bold is not None:
            out.append(f"<strong>{inline(bold)}</strong>")
        elif _SCHEME.match(target):  # not a file beside the report: shown, never a link the page follows
            out.append(f"{inline(label)} ({esc(target)})")
        else:
            out.append(f'<a href="{esc(target)}">{inline(label)}</a>')
        pos = m.end()
    out.append(esc(text[pos:]))
    return "".join(out)


def plain(text: str) -> str:
    """Markdown inline text without its markup (for ids and alt text)."""
    return _INLINE.sub(lambda m: m.group(1) or m.group(2) or m.group(3) or "", text)


def _cells(line: str) -> list[str]:
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") and not body.endswith("\\|") else body
    return [c.strip().replace("\\|", "|") for c in _CELL_SPLIT.split(body)]


def _starts_block(lines: Sequence[str], i: int) -> bool:
    line = lines[i]
    return bool(_HEADING.match(line) or line.startswith("- ") or _IMAGE.match(line.strip())
                or (line.startswith("|") and i + 1 < len(lines) and _RULE.match(lines[i + 1])))


def blocks(markdown: str) -> Iterator[tuple]:
    """``("heading", level, text)``, ``("table", headers, aligns, rows)``, ``("image", alt, target)``,
    ``("list", items)`` and ``("para", text)``, in order."""
    lines = markdown.splitlines()
    i, n = 0, len(lines)
    while i < n:
        line = lines[i]
        if not line.strip():
            i += 1
        elif m := _HEADING.match(line):
            yield "heading", len(m.group(1)), m.group(2)
            i += 1
        elif m := _IMAGE.match(line.strip()):
            yield "image", m.group(1), m.group(2)
            i += 1
        elif line.startswith("|") and i + 1 < n and _RULE.match(lines[i + 1]):
            headers = _cells(line)
            aligns = ["right" if c.endswith(":") else "left" for c in _cells(lines[i + 1])]
            rows, i = [], i + 2
            while i < n and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            yield "table", headers, aligns, rows
        elif line.startswith("- "):
            items = []
            while i < n and (lines[i].startswith("- ") or (items and lines[i].startswith("  ") and lines[i].strip())):
                if lines[i].startswith("- "):
                    items.append(lines[i][2:])
                else:
                    items[-1] += " " + lines[i].strip()
                i += 1
            yield "list", items
        else:
            para = [line.strip()]
            i += 1
            while i < n and lines[i].strip() and not _starts_block(lines, i):
                para.append(lines[i].strip())
                i += 1
            yield "para", " ".join(para)


# ----------------------------------------------------------------------------
# Pieces of the page


class _Ids:
    """Unique ``id`` attributes from captions."""

    def __init__(self) -> None:
        self.used: Counter = Counter()

    def __call__(self, prefix: str, text: str) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", plain(text).lower()).strip("-") or "x"
        base = f"{prefix}-{slug}"
        self.used[base] += 1
        return base if self.used[base] == 1 else f"{base}-{self.used[base]}"


def table_html(table_id: str, caption: str, headers: Sequence[str], rows: Iterable[Sequence[str]],
               aligns: Sequence[str] = ()) -> str:
    """A table from HTML pieces (``caption``, headers and cells already escaped or rendered)."""
    def cls(j: int) -> str:
        return ' class="num"' if j < len(aligns) and aligns[j] == "right" else ""

    head = "".join(f'<th scope="col"{cls(j)}>{h}</th>' for j, h in enumerate(headers))
    body = "\n".join("<tr>" + "".join(f"<td{cls(j)}>{c}</td>" for j, c in enumerate(row)) + "</tr>"
                     for row in rows)
    return (f'<table id="{esc(table_id)}">\n<caption>{caption}</caption>\n'
            f"<thead><tr>{head}</tr></thead>\n<tbody>\n{body}\n</tbody>\n</table>")


def figure_html(out_dir: Path, alt: str, target: str) -> str:
    """The figure file ``target`` (next to the report) as an ``<img>`` with a data: URI: its PNG, else its SVG."""
    name = Path(target).name  # the report names its figures by bare file name; never read outside out_dir
    for path in dict.fromkeys((out_dir / name, (out_dir / name).with_suffix(".png"),
                               (out_dir / name).with_suffix(".svg"))):
        if path.suffix in _MIME and path.is_file():
            data = base64.b64encode(path.read_bytes()).decode("ascii")
            return (f'<figure><img src="data:{_MIME[path.suffix]};base64,{data}" alt="{esc(plain(alt))}">'
                    f"<figcaption>{inline(alt)} (<code>{esc(path.name)}</code>)</figcaption></figure>")
    return (f'<p class="missing">Figure {inline(alt)}: no PNG or SVG of <code>{esc(name)}</code> to embed '
            f"(<code>format=[png]</code> or <code>[svg]</code> writes one).</p>")


def markdown_html(markdown: str, out_dir: Path, ids: _Ids) -> tuple[list[str], list[tuple[str, str]]]:
    """The report's Markdown as HTML blocks, and (id, caption as HTML) of each table in order."""
    out, toc, heading, under = [], [], "", 0
    for kind, *rest in blocks(markdown):
        if kind == "heading":
            level, text = rest
            heading, under = text, 0
            out.append(f'<h{level} id="{ids("sec", text)}">{inline(text)}</h{level}>')
        elif kind == "table":
            headers, aligns, rows = rest
            under += 1
            caption = (heading or "Table") + (f" (table {under})" if under > 1 else "")
            table_id = ids("table", caption)
            toc.append((table_id, inline(caption)))
            out.append(table_html(table_id, inline(caption), [inline(h) for h in headers],
                                  [[inline(c) for c in row] for row in rows], aligns))
        elif kind == "image":
            out.append(figure_html(out_dir, *rest))
        elif kind == "list":
            out.append("<ul>\n" + "\n".join(f"<li>{inline(item)}</li>" for item in rest[0]) + "\n</ul>")
        else:
            out.append(f"<p>{inline(rest[0])}</p>")
    return out, toc


def _natural(value: Any) -> tuple:
    """Numbers in numeric order, before text in text order ("2" before "16")."""
    try:
        return (0, float(value), "")
    except (TypeError, ValueError):
        return (1, 0.0, str(value))


def _values(values: Iterable[Any]) -> str:
    return ", ".join(map(str, sorted(set(values), key=_natural)))


def _flatten(obj: Any, prefix: str = "") -> dict[str, str]:
    """A nested config as ``dotted.key -> value`` (YAML's spelling of null, booleans and lists)."""
    if isinstance(obj, dict) and obj:
        out: dict[str, str] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if obj is None or isinstance(obj, bool):
        return {prefix: {None: "null", True: "true", False: "false"}[obj]}
    if isinstance(obj, (str, int, float)):
        return {prefix: str(obj)}
    return {prefix: yaml.dump(obj, Dumper=_Dumper, default_flow_style=True, width=10**9).strip()}


_MAX_DEPTH = 64  # a run's config.yaml nests a few levels; libyaml's composer overflows the C stack on deep ones


def _too_deep(text: str, limit: int) -> bool:
    """Does ``text``'s YAML nest deeper than ``limit``? From the parser's events, stopping at the first that
    passes it (libyaml's parser keeps its own stack; its composer recurses in C, so it must never see a document
    nested thousands deep, flow or block style)."""
    depth = 0
    try:
        for event in yaml.parse(text, Loader=_Loader):
            if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                depth += 1
                if depth > limit:
                    return True
            elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                depth -= 1
    except yaml.YAMLError as e:
        if "nesting depth" in str(e):  # libyaml >= 0.2.5 stops at its own limit (1000) with a scanner error
            return True
        raise
    return False


def _read_config(run: RunResult) -> dict[str, str] | None:
    path = run.path.parent / CONFIG_FILE
    try:
        text = path.read_text(encoding="utf-8")
        if _too_deep(text, _MAX_DEPTH):  # libyaml's composer would crash the process (a segfault), not raise
            logger.warning("%s: nested more than %d levels deep, not a run's config; left out of the page", path,
                           _MAX_DEPTH)
            return None
        return _flatten(yaml.load(text, Loader=_Loader))
    except yaml.YAMLError as e:
        logger.warning("%s: not valid YAML (%s); left out of the page", path, str(e).splitlines()[0])
        return None
    except (OSError, UnicodeDecodeError, RecursionError):
        return None


def _code(text: Any) -> str:
    return f"<code>{esc(text)}</code>"


def settings_html(runs: Sequence[RunResult], conventions: dict | None, ids: _Ids) -> tuple[str, list[tuple[str, str]]]:
    """The run settings: what ran (datasets, shots, seeds), the report's conventions, each method's config."""
    out, toc = ['<h2 id="sec-run-settings">Run settings</h2>'], []
    groups: dict[tuple[str, str, str], list[RunResult]] = {}
    for r in sorted(runs, key=lambda r: (r.protocol, r.backbone, r.method)):
        groups.setdefault((r.protocol, r.backbone, r.method), []).append(r)
    caption = "Runs: datasets, shots and seeds per protocol, backbone and method"
    table_id = ids("table", "runs")
    toc.append((table_id, esc(caption)))
    rows = [[_code(p), _code(bb), _code(m), esc(_values(r.dataset for r in rs)), esc(_values(r.shots for r in rs)),
             esc(_values(r.seed for r in rs)), str(len(rs))] for (p, bb, m), rs in groups.items()]
    out.append(table_html(table_id, esc(caption),
                          ["Protocol", "Backbone", "Method", "Datasets", "Shots", "Seeds", "Runs"], rows,
                          ["left"] * 6 + ["right"]))
    if conventions:
        out.append('<h3 id="sec-conventions">Conventions (confidence intervals, averages, cost)</h3>\n<dl>')
        out += [f"<dt>{_code(k)}</dt><dd>{esc(v)}</dd>" for k, v in conventions.items()]
        out.append("</dl>")
    out.append(f'<h3 id="sec-configuration">Configuration (each run\'s {_code(CONFIG_FILE)})</h3>')
    by_method: dict[str, list[RunResult]] = {}
    for r in runs:
        by_method.setdefault(r.method, []).append(r)
    for method in sorted(by_method):
        configs = [c for c in map(_read_config, by_method[method]) if c is not None]
        missing = len(by_method[method]) - len(configs)
        note = f"; {missing} without a readable {CONFIG_FILE}" if missing else ""
        if not configs:
            out.append(f"<p>{_code(method)}: no run has a readable {CONFIG_FILE}.</p>")
            continue
        rows, varying = [], []
        for k in dict.fromkeys(k for c in configs for k in c):
            distinct = sorted(set(c.get(k, "(absent)") for c in configs), key=_natural)
            if len(distinct) > 1:
                varying.append(k)
                more = len(distinct) - _SHOWN_VALUES
                rows.append([_code(k), f"{len(distinct)} values: "
                             + ", ".join(map(_code, distinct[:_SHOWN_VALUES]))
                             + (f" … ({more} more)" if more > 0 else "")])
            else:
                rows.append([_code(k), _code(distinct[0])])
        caption = f"Configuration of {_code(method)} ({len(configs)} runs{esc(note)})"
        table_id = ids("table", f"config {method}")
        toc.append((table_id, caption))
        summary = (f"{_code(method)}: {len(configs)} runs{esc(note)}; varying: "
                   + (", ".join(map(_code, varying)) or "nothing"))
        out.append(f"<details><summary>{summary}</summary>\n"
                   f"{table_html(table_id, caption, ['Key', 'Value'], rows)}\n</details>")
    return "\n".join(out), toc


# ----------------------------------------------------------------------------
# The page


def render_html(markdown: str, out_dir: Path, runs: Sequence[RunResult], conventions: dict | None = None,
                title: str = "fewclip report") -> str:
    """The whole page: the report's Markdown (tables and embedded figures), then the run settings."""
    ids = _Ids()
    body, toc = markdown_html(markdown, Path(out_dir), ids)
    title_block = body.pop(0) if body and body[0].startswith("<h1") else ""
    settings, settings_toc = settings_html(runs, conventions, ids)
    contents = "\n".join(f'<li><a href="#{esc(i)}">{c}</a></li>' for i, c in [*toc, *settings_toc])
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(title)}</title>",
        f"<style>{_STYLE}</style>",
        "</head>",
        "<body>",
        title_block,
        f'<nav><details open><summary>Tables</summary>\n<ol>\n{contents}\n</ol>\n</details></nav>',
        *body,
        settings,
        "</body>",
        "</html>",
        "",
    ])


def write_html(report, out_dir: str | Path) -> Path:
    """Write ``report.html`` for a written report (``report.paths``: its figures and ``report.json``)."""
    out_dir = Path(out_dir)
    conventions = None
    json_path = report.paths.get("json")
    if json_path is not None:
        try:
            conventions = json.loads(Path(json_path).read_text(encoding="utf-8")).get("conventions")
        except (OSError, ValueError, AttributeError) as e:
            logger.warning("report.html: could not read the conventions from %s (%s); the page leaves them out",
                           json_path, e)
    return atomic_write_text(out_dir / HTML_FILE, render_html(report.markdown, out_dir, report.runs, conventions))
