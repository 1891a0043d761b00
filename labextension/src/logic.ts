/**
 * The logic of the extension, free of JupyterLab imports so that it is unit-tested with jest:
 * reading an insert request from the kernel, deciding where the new cell goes, and rendering a report as HTML.
 * The report's types are generated from its JSON Schemas (src/report.ts, `npm run types`); every number the
 * renderer shows comes worded by the Python views in the bundle's `view` block (tfmem_magic.show.render.lab_view),
 * so that the lab renderer and the static HTML say the same.
 */
import type { HeldView, LineRow, Report, ReportView, TimelineSeries } from './report';

export type Placement = 'below' | 'top';

export interface InsertRequest {
  code: string;
  cellId: string | null;
  placement: Placement;
}

/** Validate the comm message a kernel sends (`tfmem_magic.show.frontend.insert_cell`). */
export function parseInsertRequest(data: unknown): InsertRequest | { error: string } {
  if (typeof data !== 'object' || data === null) {
    return { error: 'no data' };
  }
  const d = data as Record<string, unknown>;
  if (typeof d.code !== 'string' || d.code.length === 0) {
    return { error: 'no code to insert' };
  }
  const placement = d.placement === 'top' ? 'top' : 'below';
  const cellId = typeof d.cell_id === 'string' && d.cell_id ? d.cell_id : null;
  return { code: d.code, cellId, placement };
}

export interface Target {
  /** the index of the cell to insert next to */
  index: number;
  /** insert above it (top of the notebook) or below it */
  where: 'above' | 'below';
  /** the cell that ran was found by its id (else the active cell was used) */
  found: boolean;
}

/** Where the fix cell goes: below the cell that produced the panel (by id; the active cell if it is gone),
 * or above the first cell for fixes that need a restart. */
export function insertionTarget(cellIds: string[], request: InsertRequest, activeIndex: number): Target {
  if (request.placement === 'top') {
    return { index: 0, where: 'above', found: true };
  }
  const at = request.cellId === null ? -1 : cellIds.indexOf(request.cellId);
  if (at >= 0) {
    return { index: at, where: 'below', found: true };
  }
  const fallback = Math.min(Math.max(activeIndex, 0), Math.max(cellIds.length - 1, 0));
  return { index: fallback, where: 'below', found: false };
}

const ESCAPES: Record<string, string> = { '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' };

export function escapeHtml(value: unknown): string {
  return String(value ?? '').replace(/[&<>"']/g, c => ESCAPES[c]);
}

/** The report as its MIME bundle carries it: the report (tfmem_magic/report.schema.json) with the `view` block
 * (schema/view.schema.json). A bundle saved by an older tfmem_magic may lack keys added since. */
export type ReportBundle = Report & { view?: ReportView };

/** The data is a tfmem report (of any version of the schema). */
export function isReport(data: unknown): data is ReportBundle {
  return (
    typeof data === 'object' &&
    data !== null &&
    String((data as { schema?: unknown }).schema ?? '').startsWith('tfmem.report/')
  );
}

/** Where a timeline series' [t, bytes] points are in the report. */
function seriesPoints(report: ReportBundle, series: TimelineSeries): number[][] {
  switch (series.kind) {
    case 'trace':
      return report.trace?.timeline ?? [];
    case 'device':
      return (series.device !== undefined && report.tf?.[series.device]?.samples) || [];
    case 'rss':
      return report.rss?.samples ?? [];
  }
  return [];
}

const SERIES_COLORS: Record<TimelineSeries['kind'], string> = { trace: '#5b8def', device: '#5b8def', rss: '#9e9e9e' };

/** Inline SVGs of the view's timeline series (TF live bytes: the trace's, else the sampled device's; process RSS),
 * each on its own scale (RSS is often 1000x TF's bytes), with the ranges the Python view wrote. */
export function timelineSvg(report: ReportBundle): string {
  const series = (report.view?.timeline ?? [])
    .map(s => ({ ...s, points: seriesPoints(report, s) }))
    .filter(s => s.points.length >= 2);
  if (series.length === 0) {
    return '';
  }
  const tMax = Math.max(...series.flatMap(s => s.points.map(p => p[0])), 1e-6);
  const w = 600;
  const h = 60;
  return series
    .map(s => {
      const values = s.points.map(p => p[1]);
      const top = Math.max(...values, 1);
      const bottom = s.from_zero ? 0 : Math.min(...values);
      const span = Math.max(top - bottom, 1);
      const d = s.points
        .map(
          (p, i) =>
            `${i ? 'L' : 'M'}${((p[0] / tMax) * w).toFixed(1)},${(h - ((p[1] - bottom) / span) * (h - 2) - 1).toFixed(1)}`
        )
        .join('');
      const color = SERIES_COLORS[s.kind] ?? SERIES_COLORS.trace;
      return (
        `<div class="tfmem-muted"><span style="color:${color}">■</span> ${escapeHtml(s.name)}: ` +
        `${escapeHtml(s.low)} → ${escapeHtml(s.high)} over ${escapeHtml(s.seconds)}</div>` +
        `<svg class="tfmem-timeline" viewBox="0 0 ${w} ${h}" width="${w}" height="${h}" role="img" ` +
        `aria-label="${escapeHtml(s.name)} over the cell"><path d="${d}" fill="none" stroke="${color}" ` +
        'stroke-width="1.5"/></svg>'
      );
    })
    .join('');
}

/** The "Held after" section: who holds TensorFlow memory at the cell's end, in the words the Python view chose
 * (`view.held`: headline, hint, and [name, kind, what it holds, bytes] rows), and what the cell left live by the line
 * of code that made it (`view.held.by_line`, absent where the trace did not cover the whole cell). Empty when
 * neither is there. */
export function heldHtml(held: HeldView | undefined): string {
  const holders = Array.isArray(held?.holders) ? held.holders : [];
  const lines = Array.isArray(held?.by_line);
  if (!held || (!holders.length && !lines)) {
    return '';
  }
  const rows = holders
    .map(
      row =>
        `<tr><td><code>${escapeHtml(row[0])}</code></td><td>${escapeHtml(row[1])}</td>` +
        `<td>${escapeHtml(row[2])}</td><td class="num">${escapeHtml(row[3])}</td></tr>`
    )
    .join('');
  return (
    `<h4>Held after the cell</h4><div class="tfmem-held">${escapeHtml(held.headline)}</div>` +
    (rows
      ? '<table class="tfmem-holders"><tr><th>held by</th><th>is</th><th>holds</th><th class="num">bytes</th></tr>' +
        `${rows}</table>`
      : '') +
    (lines ? byLineHtml(held.by_line, held.by_line_note, END_LINES) : '') +
    (held.hint ? `<div class="tfmem-muted">${escapeHtml(held.hint)}</div>` : '')
  );
}

function peakRows(rows: { label: string; bytes: string; share: number }[] | undefined): string {
  return (rows ?? [])
    .map(
      row =>
        `<tr><td>${escapeHtml(row.label)}</td><td class="num">${escapeHtml(row.bytes)}</td>` +
        `<td><span class="tfmem-bar" style="width:${Math.max(1, Math.round(160 * (Number(row.share) || 0)))}px">` +
        '</span></td></tr>'
    )
    .join('');
}

/** What a by-line view groups, in the words of its heading (tfmem_magic.show.view.PEAK_LINES and END_LINES). */
export const PEAK_LINES = 'what was live at the peak';
export const END_LINES = 'what the cell left live at its end';

/** A "By line" table: each line of code that made `what` the view groups (what was live at the peak:
 * `view.peak.by_line`; what the cell left live: `view.held.by_line`), with its text as code, its bytes, its
 * forward/backward split, its largest tensor and, for a layer's line, the line that made the layer; then `note`, what
 * no line made. The rows come worded by the Python view (show/view.py by_line_rows), and the markup is that of the
 * static report's (tfmem_magic.show.render.lines_html). Empty without rows (quick mode, a saved trace, a bundle from
 * an older tfmem_magic). */
export function byLineHtml(rows: LineRow[] | undefined, note: string | null | undefined, what: string): string {
  if (!Array.isArray(rows)) {
    return '';
  }
  const cells = rows
    .map(row => {
      const code = row.code ? `<code>${escapeHtml(row.code)}</code>` : '';
      const made = escapeHtml(row.made_by) + (row.made_by_code ? `: <code>${escapeHtml(row.made_by_code)}</code>` : '');
      const more = [escapeHtml(row.split), escapeHtml(row.largest), made].filter(x => x).join(' · ');
      return (
        `<tr><td>${escapeHtml(row.label)}</td><td>${code}</td><td class="num">${escapeHtml(row.bytes)}</td>` +
        `<td><span class="tfmem-bar" style="width:${Math.max(1, Math.round(160 * (Number(row.share) || 0)))}px">` +
        '</span></td></tr>' +
        (more ? `<tr class="tfmem-line-detail"><td></td><td colspan="3" class="tfmem-muted">${more}</td></tr>` : '')
      );
    })
    .join('');
  const table = cells
    ? '<table class="tfmem-by-line"><tr><th>line</th><th>code</th><th class="num">bytes</th><th></th></tr>' +
      `${cells}</table>`
    : `<div class="tfmem-muted">No line of code made ${escapeHtml(what)}.</div>`;
  const said = note ? `<div class="tfmem-muted tfmem-by-line-note">${escapeHtml(note)}</div>` : '';
  return (
    `<div class="tfmem-by-line-view"><b>By line</b>: ${escapeHtml(what)}, by the line of code that made it` +
    `${table}${said}</div>`
  );
}

/** The report as HTML (the MIME renderer of application/vnd.tfmem.report+json). Every string is escaped.
 * `text` is the bundle's text/plain: shown for a bundle from a tfmem_magic too old to carry the view's numbers. */
export function renderReportHtml(data: unknown, text?: unknown): string {
  if (!isReport(data)) {
    return '<div class="tfmem-report">Not a tfmem report.</div>';
  }
  const report = data;
  const view: Partial<ReportView> = report.view ?? {};
  const parts: string[] = [
    `<h4>tfmem report${report.label ? ' · ' + escapeHtml(report.label) : ''}` +
      `${report.number ? ' · #' + escapeHtml(report.number) : ''}</h4>`
  ];
  if (view.verdict) {
    parts.push(`<div class="tfmem-verdict tfmem-${escapeHtml(view.level || 'ok')}">${escapeHtml(view.verdict)}</div>`);
  }
  if (!view.summary) {
    parts.push(
      '<div class="tfmem-muted">Saved by an older tfmem_magic: its text form follows (run the cell again for the ' +
        `full report).</div><pre class="tfmem-text">${escapeHtml(typeof text === 'string' ? text : '')}</pre>`
    );
    return `<div class="tfmem-report tfmem-rendered">${parts.join('')}</div>`;
  }
  const rows = view.summary.map(
    ([label, value, detail]) =>
      `<tr><th>${escapeHtml(label)}</th><td>${escapeHtml(value)} ` +
      `<span class="tfmem-muted">${escapeHtml(detail)}</span></td></tr>`
  );
  if (view.model) {
    rows.push(`<tr><th>Model</th><td>${escapeHtml(view.model)}</td></tr>`);
  }
  if (report.error) {
    const message = String(report.error.message ?? '').slice(0, 300);
    rows.push(`<tr><th>Error</th><td>${escapeHtml(report.error.type)}: ${escapeHtml(message)}</td></tr>`);
  }
  if (view.error_site) {
    rows.push(`<tr><th>Failed at</th><td>${escapeHtml(view.error_site)}</td></tr>`);
  }
  parts.push(`<table class="tfmem-summary">${rows.join('')}</table>`);
  const b = report.before;
  if (b && view.before_after?.length) {
    parts.push(
      `<div class="tfmem-before-after"><b>Before → after${b.fix_id ? ' (fix ' + escapeHtml(b.fix_id) + ')' : ''}` +
        `: report ${escapeHtml(b.number)}</b><table><tr><th></th><th class="num">before</th>` +
        '<th class="num">after</th></tr>' +
        view.before_after
          .map(
            ([what, before, after]) =>
              `<tr><th>${escapeHtml(what)}</th><td class="num">${escapeHtml(before)}</td>` +
              `<td class="num">${escapeHtml(after)}</td></tr>`
          )
          .join('') +
        '</table></div>'
    );
  }
  if (view.peak) {
    parts.push(`<h4>${escapeHtml(view.peak.heading)}</h4>`);
    parts.push(`<table class="tfmem-by-phase">${peakRows(view.peak.by_phase)}</table>`);
    if (view.peak.by_layer?.length) {
      parts.push(`<table class="tfmem-by-layer">${peakRows(view.peak.by_layer)}</table>`);
    }
    parts.push(byLineHtml(view.peak.by_line, view.peak.by_line_note, PEAK_LINES));
  }
  parts.push(heldHtml(view.held));
  parts.push(timelineSvg(report));
  const findings = report.findings ?? [];
  if (findings.length) {
    parts.push(
      '<h4>Findings</h4><ul class="tfmem-findings">' +
        findings
          .map(
            f =>
              `<li><b>${escapeHtml(f.title)}</b> <span class="tfmem-muted">[${escapeHtml(f.severity)}]</span><br>` +
              `${escapeHtml(f.evidence)}</li>`
          )
          .join('') +
        '</ul>'
    );
  }
  const fixes = report.fixes ?? [];
  if (fixes.length) {
    parts.push(
      '<h4>Fixes</h4><div class="tfmem-muted">Copy a fix, or run ' +
        `<code>%tfmem fix K --report ${escapeHtml(report.number)}</code> in a live kernel.</div>` +
        '<ol class="tfmem-fixes">' +
        fixes
          .map(x => `<li><b>${escapeHtml(x.title)}</b>: ${escapeHtml(x.why)}<pre>${escapeHtml(x.code)}</pre></li>`)
          .join('') +
        '</ol>'
    );
  }
  return `<div class="tfmem-report tfmem-rendered">${parts.join('')}</div>`;
}
