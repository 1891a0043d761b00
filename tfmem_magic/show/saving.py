"""A report written to a file: the report as JSON, or a standalone HTML page, chosen by the file's suffix."""

from __future__ import annotations

from pathlib import Path

from tfmem_magic.core.report import Report


def save_report(report: Report, path: Path) -> Path:
    """Write the report as JSON or as a static HTML page, by the file's suffix."""
    if path.suffix.lower() == ".json":
        saved: Path = report.save(path)
        return saved
    from tfmem_magic.show.render import render_html  # the page's renderer, only when a page is asked for

    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>tfmem report</title></head>"
        f"<body>{render_html(report)}</body></html>"
    )
    path.write_text(page)
    return path
