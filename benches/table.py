#!/usr/bin/env python3
"""The side-by-side table and its chart, from the rows the benches recorded
(benches/results.rs: one JSON object a line).

    benches/table.py RESULTS --markdown TABLE.md --svg CHART.svg [--title T]

Each row is one call of one backend: ferrovol's figure beside a peer
driver's or a floor's (the bare tools doing the same work), from the same
run. The ratio is ferrovol's cost over the other's: a time over a time, a
size over a size, and for a rate the other's rate over ferrovol's (the
cost of one operation). Under 1, ferrovol does it cheaper.
"""

import argparse
import html
import json
import math

ORDER = ["file", "nfs", "lvm", "iscsi", "rbd"]


def cost_ratio(r):
    ours, theirs = r["ours"], r["theirs"]
    if r["better"] == "lower":
        return ours / theirs if theirs else math.inf
    return theirs / ours if ours else math.inf


def value(v, p99, unit):
    if unit == "ms":
        text = f"{v:,.1f}" if v < 1000 else f"{v:,.0f}"
        if p99 is not None:
            text += f" / {p99:,.1f}" if p99 < 1000 else f" / {p99:,.0f}"
        return text + " ms"
    if unit == "MiB":
        return f"{v:,.1f} MiB"
    return f"{v:,.0f} {unit}"


def load(path):
    """The comparisons, and the figures nothing is put beside (the fenced
    failover's steps), each in the backends' order."""
    lines = [json.loads(line) for line in open(path) if line.strip()]
    rows = [r for r in lines if not r.get("figure")]
    figures = [r for r in lines if r.get("figure")]
    for r in rows:
        r["ratio"] = cost_ratio(r)
    rank = {b: i for i, b in enumerate(ORDER)}
    # Backends in a fixed order; within one, calls as recorded.
    def order(rs):
        return sorted(rs, key=lambda r: rank.get(r["backend"], len(ORDER)))
    return order(rows), order(figures)


def figures_markdown(figures):
    """The figures nothing is put beside: no peer publishes a fenced
    failover time, and it has no floor."""
    if not figures:
        return ""
    out = [
        "",
        "| backend | step | ferrovol (p50 / worst) |",
        "| --- | --- | --- |",
    ]
    for r in figures:
        out.append(
            f"| {r['backend']} | {r['call']} | {r['ours']:,.0f} / {r['ours_worst']:,.0f} ms |"
        )
    return "\n".join(out) + "\n"


def markdown(rows, title):
    out = []
    if title:
        out.append(title)
        out.append("")
    out.append(
        "| backend | call | ferrovol (p50 / p99) | beside | its figure (p50 / p99) | ferrovol / it |"
    )
    out.append("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        beside = r["against"] + (" (floor)" if r["kind"] == "floor" else "")
        ratio = f"{r['ratio']:.2f}"
        if r["better"] == "higher":
            ratio += f" ({r['ours'] / r['theirs']:.1f}x its rate)"
        out.append(
            f"| {r['backend']} | {r['call']} | {value(r['ours'], r['ours_p99'], r['unit'])} "
            f"| {beside} | {value(r['theirs'], r['theirs_p99'], r['unit'])} | {ratio} |"
        )
    return "\n".join(out) + "\n"


def svg(rows, figures, title):
    """Horizontal bars on a log scale from the line at 1: left of it
    ferrovol costs less than the peer (or sits under the floor, which
    happens where the floor does more than the call needs), right of it
    more."""
    lo, hi = 0.01, 10.0
    label_w, plot_w, row_h, top = 420, 440, 18, 58
    height = top + row_h * len(rows) + 40
    # Below the ratios, the figures nothing is put beside: a bar per
    # figure on a linear scale in seconds, p50 solid, up to the worst pale.
    fig_top = height + 24
    if figures:
        height = fig_top + row_h * len(figures) + 30
    width = label_w + plot_w + 70

    def x(ratio):
        r = min(max(ratio, lo), hi)
        return label_w + plot_w * (math.log10(r) - math.log10(lo)) / (
            math.log10(hi) - math.log10(lo)
        )

    e = html.escape
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="8" y="18" font-size="13" font-weight="bold">{e(title)}</text>',
        '<text x="8" y="36">ferrovol\'s cost over the other\'s, log scale: left of 1, ferrovol is cheaper. '
        'Green/red: beside a peer driver; blue: beside the bare tools (the floor).</text>',
    ]
    for tick in [0.01, 0.03, 0.1, 0.3, 1, 3, 10]:
        tx = x(tick)
        parts.append(
            f'<line x1="{tx:.1f}" y1="{top - 6}" x2="{tx:.1f}" y2="{top + row_h * len(rows)}" '
            f'stroke="{"#333" if tick == 1 else "#ddd"}" stroke-width="{1.5 if tick == 1 else 1}"/>'
        )
        parts.append(
            f'<text x="{tx:.1f}" y="{top + row_h * len(rows) + 14}" text-anchor="middle">{tick:g}</text>'
        )
    def row_label(rs, i, y, label):
        """A row's label, under a dashed line where a new backend starts."""
        if i > 0 and rs[i - 1]["backend"] != rs[i]["backend"]:
            parts.append(
                f'<line x1="8" y1="{y}" x2="{width - 8}" y2="{y}" stroke="#999" stroke-dasharray="2,3"/>'
            )
        parts.append(f'<text x="8" y="{y + 13}">{e(label[:68])}</text>')

    for i, r in enumerate(rows):
        y = top + i * row_h
        row_label(rows, i, y, f"{r['backend']}: {r['call']} / {r['against']}")
        ratio = r["ratio"]
        if r["kind"] == "floor":
            colour = "#1565c0" if ratio <= 1 else "#64b5f6"
        else:
            colour = "#2e7d32" if ratio <= 1 else "#c62828"
        x0, x1 = sorted([x(1), x(ratio)])
        parts.append(
            f'<rect x="{x0:.1f}" y="{y + 3}" width="{max(x1 - x0, 1):.1f}" height="{row_h - 6}" fill="{colour}"/>'
        )
        tx = x(ratio) + (4 if ratio >= 1 else -4)
        anchor = "start" if ratio >= 1 else "end"
        parts.append(
            f'<text x="{tx:.1f}" y="{y + 13}" text-anchor="{anchor}">{ratio:.2f}</text>'
        )
    if figures:
        most = max(r["ours_worst"] for r in figures) or 1.0
        parts.append(
            f'<text x="8" y="{fig_top - 8}" font-weight="bold">A fenced failover, by step '
            f"(no peer publishes one): p50, and pale up to the worst; "
            f"the scale ends at {most / 1e3:.1f} s</text>"
        )
        for i, r in enumerate(figures):
            y = fig_top + i * row_h
            row_label(figures, i, y, f"{r['backend']}: {r['call']}")
            w50 = plot_w * r["ours"] / most
            wworst = plot_w * r["ours_worst"] / most
            parts.append(
                f'<rect x="{label_w}" y="{y + 3}" width="{max(wworst, 1):.1f}" height="{row_h - 6}" fill="#b0bec5"/>'
            )
            parts.append(
                f'<rect x="{label_w}" y="{y + 3}" width="{max(w50, 1):.1f}" height="{row_h - 6}" fill="#455a64"/>'
            )
            parts.append(
                f'<text x="{label_w + max(wworst, 1) + 4:.1f}" y="{y + 13}">'
                f'{r["ours"] / 1e3:.2f} / {r["ours_worst"] / 1e3:.2f} s</text>'
            )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results")
    ap.add_argument("--markdown")
    ap.add_argument("--svg")
    ap.add_argument("--title", default="ferrovol beside its peers and floors")
    a = ap.parse_args()
    rows, figures = load(a.results)
    if not rows and not figures:
        raise SystemExit(f"{a.results}: no rows")
    md = markdown(rows, "") + figures_markdown(figures)
    print(md, end="")
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md)
    if a.svg:
        with open(a.svg, "w") as f:
            f.write(svg(rows, figures, a.title))


if __name__ == "__main__":
    main()
