"""The cluster view as text and as a static HTML table (saved notebooks, nbconvert and GitHub show it too)."""

from __future__ import annotations

from html import escape

from tfmem_magic.analyze.cluster import ClusterView
from tfmem_magic.core.sizes import format_bytes

_COLUMNS = ("worker", "device", "peak", "grown in the capture", "peak at", "what held the most", "budget")


def _cells(view: ClusterView) -> list[list[str]]:
    rows = []
    worst = view.worst
    for row in view.rows:
        report = row.report
        if report is None:
            rows.append([row.worker, "-", "-", "-", "-", f"no report: {row.error or '?'}", "-"])
            continue
        budget = report.device_budget
        trace = report.trace
        rows.append(
            [
                row.worker + (" (worst)" if row is worst and len(view.rows) > 1 else ""),
                row.device or "-",
                format_bytes(row.peak_bytes) if row.peak_bytes is not None else "-",
                format_bytes(row.growth_bytes) if row.growth_bytes is not None else "-",
                f"{trace.peak_time_s:.2f} s" if trace is not None and trace.events else "-",
                row.dominant or ("-" if trace is not None else "no breakdown (no trace)"),
                format_bytes(budget[1]) if budget else "-",
            ]
        )
    return rows


def cluster_text(view: ClusterView) -> str:
    rows = [list(_COLUMNS), *_cells(view)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = [f"tfmem cluster · {len(view.rows)} worker(s)"]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines += [f"- {finding}" for finding in view.findings]
    return "\n".join(lines)


def cluster_html(view: ClusterView) -> str:
    head = "".join(f"<th style='text-align:left;padding:2px 8px'>{escape(c)}</th>" for c in _COLUMNS)
    body = "".join(
        "<tr>" + "".join(f"<td style='padding:2px 8px'>{escape(c)}</td>" for c in row) + "</tr>" for row in _cells(view)
    )
    findings = "".join(f"<li>{escape(f)}</li>" for f in view.findings)
    return (
        f"<div class='tfmem-cluster'><b>tfmem cluster</b> · {len(view.rows)} worker(s)"
        f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
        + (f"<ul>{findings}</ul>" if findings else "")
        + "</div>"
    )
