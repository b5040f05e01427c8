"""`unbroken goodput`'s HTML report: one file, no network. The figures travel as JSON
inside the page and a short script draws the table and the timeline (inline SVG) from
them, so what the page shows is what `unbroken goodput` prints (`report.figures`)."""

from __future__ import annotations

import html
import json

from unbroken.goodput.account import Account
from unbroken.goodput.report import COLOURS, figures, pct

STYLE = """body{font:14px system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse}td,th{padding:3px 10px;text-align:right}
td:first-child,th:first-child{text-align:left}tr.total td{border-top:1px solid #888}
.sw{display:inline-block;width:10px;height:10px;margin-right:6px}"""

SCRIPT = """
const d = JSON.parse(document.getElementById('data').textContent);
const body = document.getElementById('figures');
for (const [key, what, seconds, share] of d.rows) {
  const tr = body.insertRow();
  tr.id = 'row-' + key;
  if (key === 'wall') tr.className = 'total';
  const c = d.colours[key] || 'transparent';
  tr.insertCell().innerHTML = `<span class="sw" style="background:${c}"></span>${what}`;
  tr.insertCell().textContent = seconds;
  tr.insertCell().textContent = share;
}
document.getElementById('goodput').textContent = d.goodput;
const W = 900, H = 26, ns = 'http://www.w3.org/2000/svg';
const svg = document.getElementById('timeline');
svg.setAttribute('viewBox', `0 0 ${W + 70} ${d.ranks.length * H + 30}`);
const x = t => 70 + W * t / d.wall;
const el = (name, attrs) => {
  const e = document.createElementNS(ns, name);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  svg.appendChild(e); return e;
};
d.ranks.forEach(([rank, segs], i) => {
  el('text', {x: 0, y: i * H + 17, 'font-size': 12}).textContent = 'rank ' + rank;
  for (const [a, b, k] of segs)
    el('rect', {x: x(a), y: i * H + 4, width: Math.max(x(b) - x(a), 0.3), height: H - 8,
                fill: d.colours[k]}).appendChild(document.createElementNS(ns, 'title'))
      .textContent = `${k} ${a.toFixed(2)}-${b.toFixed(2)} s`;
});
for (const f of d.failures) {
  el('line', {x1: x(f.t), x2: x(f.t), y1: 0, y2: d.ranks.length * H, stroke: 'black',
              'stroke-dasharray': '4 3'});
}
el('text', {x: 70, y: d.ranks.length * H + 22, 'font-size': 11}).textContent =
  `0 s ... ${d.wall.toFixed(2)} s since launch`;
"""


def page(a: Account, where: str) -> str:
    data = {
        "rows": figures(a),
        "colours": COLOURS,
        "goodput": pct(a.seconds["productive"], a.wall_s),
        "wall": a.wall_s,
        "ranks": [
            [r, [[round(s, 4), round(e, 4), k] for s, e, k in a.segments[r]]] for r in a.ranks
        ],
        "failures": a.failures,
    }
    blob = json.dumps(data).replace("</", "<\\/")
    failures = (
        "".join(
            f"<li>{f['t']:.2f} s: {html.escape(str(f['what']))} (step {f['step']})</li>"
            for f in a.failures
        )
        or "<li>none</li>"
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>goodput: {html.escape(where)}</title>
<style>{STYLE}</style></head><body>
<h1>Goodput <span id="goodput"></span></h1>
<p>{html.escape(where)}: {len(a.ranks)} rank(s), {a.wall_s:.2f} s, {a.steps_recomputed}
step(s) recomputed; background persists {a.persist_s:.2f} s per rank (overlapped).</p>
<table><thead><tr><th></th><th>seconds</th><th>share</th></tr></thead>
<tbody id="figures"></tbody></table>
<h2>Timeline</h2><svg id="timeline" width="100%"></svg>
<h2>Failures</h2><ul>{failures}</ul>
<script type="application/json" id="data">{blob}</script>
<script>{SCRIPT}</script>
</body></html>
"""
