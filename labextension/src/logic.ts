/**
 * The logic of the extension, free of JupyterLab imports so that it is unit-tested with jest:
 * reading an insert request from the kernel, deciding where the new cell goes, and rendering a report as HTML.
 */

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

const UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];

/** The same format as tfmem_magic.core.sizes.format_bytes: 0 B, 812 B, 3.4 KiB, 1.25 GiB, 640 MiB. */
export function formatBytes(n: number | null | undefined): string {
  if (n === null || n === undefined || !isFinite(n)) {
    return 'n/a';
  }
  const sign = n < 0 ? '-' : '';
  let value = Math.abs(n);
  for (let unit = 0; unit < UNITS.length; unit++) {
    if (value < 1024 || unit === UNITS.length - 1) {
      if (unit === 0) {
        return `${sign}${Math.trunc(value)} B`;
      }
      // Python's "%.3g": three significant digits, trailing zeros dropped
      const text = value < 100 ? String(Number(value.toPrecision(3))) : value.toFixed(0);
      return `${sign}${text} ${UNITS[unit]}`;
    }
    value /= 1024;
  }
  return 'n/a';
}

/* eslint-disable @typescript-eslint/no-explicit-any */
type Json = any;

/** The device the report is about: the kernel's one decision (view.main_device), else CPU:0, else the first. */
function mainDevice(report: Json): Json | null {
  const tf = report.tf || {};
  const chosen = (report.view || {}).main_device;
  return (chosen && tf[chosen]) || tf['CPU:0'] || Object.values(tf)[0] || null;
}

function groupRows(groups: Json[], key: string, total: number): string {
  return (groups || [])
    .slice(0, 10)
    .map((g: Json) => {
      const width = total > 0 ? Math.max(1, Math.round((160 * g.bytes) / total)) : 1;
      return (
        `<tr><td>${escapeHtml(g[key] || '—')}</td><td class="num">${escapeHtml(formatBytes(g.bytes))}</td>` +
        `<td><span class="tfmem-bar" style="width:${width}px"></span></td></tr>`
      );
    })
    .join('');
}

/** Inline SVGs of TF live bytes (trace timeline, else the sampled values) and of process RSS over the cell, each on
 * its own scale (RSS is often 1000x TF's bytes). */
export function timelineSvg(report: Json): string {
  const tfPoints: number[][] =
    report.trace && report.trace.timeline && report.trace.timeline.length >= 2
      ? report.trace.timeline
      : (mainDevice(report) || {}).samples || [];
  const rss: number[][] = (report.rss && report.rss.samples) || [];
  const series = [
    { points: tfPoints, color: '#5b8def', name: 'TF live bytes', fromZero: true },
    { points: rss, color: '#9e9e9e', name: 'process RSS', fromZero: false }
  ].filter(s => s.points.length >= 2);
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
      const bottom = s.fromZero ? 0 : Math.min(...values);
      const span = Math.max(top - bottom, 1);
      const d = s.points
        .map(
          (p, i) =>
            `${i ? 'L' : 'M'}${((p[0] / tMax) * w).toFixed(1)},${(h - ((p[1] - bottom) / span) * (h - 2) - 1).toFixed(1)}`
        )
        .join('');
      return (
        `<div class="tfmem-muted"><span style="color:${s.color}">■</span> ${s.name}: ` +
        `${escapeHtml(formatBytes(bottom))} → ${escapeHtml(formatBytes(top))} over ${tMax.toFixed(2)} s</div>` +
        `<svg class="tfmem-timeline" viewBox="0 0 ${w} ${h}" width="${w}" height="${h}" role="img" ` +
        `aria-label="${s.name} over the cell"><path d="${d}" fill="none" stroke="${s.color}" stroke-width="1.5"/></svg>`
      );
    })
    .join('');
}

/** '256', or '256 (128 per replica of 2)' under a tf.distribute strategy (as ModelInfo.batch_text says it). */
export function batchText(model: Json): string {
  const batch = model.batch_size;
  if (!batch) {
    return '?';
  }
  const replicas = Number(model.replicas || 1);
  return replicas > 1 ? `${batch} (${Math.floor(batch / replicas)} per replica of ${replicas})` : `${batch}`;
}

/** The "Held after" section: who holds TensorFlow memory at the cell's end, in the words the Python view chose
 * (`view.held`: headline, hint, and [name, kind, what it holds, bytes] rows). Empty when nothing is held. */
export function heldHtml(held: Json): string {
  if (!held || !Array.isArray(held.holders) || !held.holders.length) {
    return '';
  }
  const rows = held.holders
    .map(
      (row: Json[]) =>
        `<tr><td><code>${escapeHtml(row[0])}</code></td><td>${escapeHtml(row[1])}</td>` +
        `<td>${escapeHtml(row[2])}</td><td class="num">${escapeHtml(row[3])}</td></tr>`
    )
    .join('');
  return (
    `<h4>Held after the cell</h4><div class="tfmem-held">${escapeHtml(held.headline)}</div>` +
    '<table class="tfmem-holders"><tr><th>held by</th><th>is</th><th>holds</th><th class="num">bytes</th></tr>' +
    `${rows}</table>` +
    (held.hint ? `<div class="tfmem-muted">${escapeHtml(held.hint)}</div>` : '')
  );
}

/** The report as HTML (the MIME renderer of application/vnd.tfmem.report+json). Every string is escaped. */
export function renderReportHtml(report: Json): string {
  if (!report || typeof report !== 'object' || String(report.schema || '').indexOf('tfmem.report/') !== 0) {
    return '<div class="tfmem-report">Not a tfmem report.</div>';
  }
  const view = report.view || {};
  const dev = mainDevice(report);
  const rows: [string, string][] = [];
  if (dev) {
    rows.push([
      'TF peak',
      `${formatBytes(dev.peak_bytes)} (${formatBytes(dev.baseline_bytes)} before + ` +
        `${formatBytes(dev.peak_bytes - dev.baseline_bytes)} in the cell)`
    ]);
  }
  const rss = report.rss || {};
  rows.push([
    'Process RSS peak',
    `${formatBytes(rss.peak_bytes)} (+${formatBytes(rss.peak_bytes - rss.baseline_bytes)})`
  ]);
  const env = report.env || {};
  // a GPU's budget is its allocator's limit (traced); the host's (RAM, container, --limit) is the process's
  const deviceLimit = dev && view.main_device ? (env.device_limit_bytes || {})[view.main_device] : undefined;
  if (deviceLimit) {
    rows.push([`${view.main_device} budget`, `${formatBytes(deviceLimit)} (TensorFlow's allocator limit)`]);
  }
  rows.push([deviceLimit ? 'Host budget' : 'Budget', `${formatBytes(env.budget_bytes)} (${env.budget_source || '?'})`]);
  rows.push(['Time', `${Number(report.wall_s || 0).toFixed(2)} s, ${report.mode} mode`]);
  if (report.model) {
    const m = report.model;
    rows.push([
      'Model',
      `${m.name}: ${Number(m.params).toLocaleString('en')} params, optimizer ${m.optimizer || 'none'}, ` +
        `batch ${batchText(m)}`
    ]);
  }
  if (report.error) {
    rows.push(['Error', `${report.error.type}: ${String(report.error.message || '').slice(0, 300)}`]);
  }
  const parts: string[] = [
    `<h4>tfmem report${report.label ? ' · ' + escapeHtml(report.label) : ''}` +
      `${report.number ? ' · #' + escapeHtml(report.number) : ''}</h4>`
  ];
  if (view.verdict) {
    parts.push(`<div class="tfmem-verdict tfmem-${escapeHtml(view.level || 'ok')}">${escapeHtml(view.verdict)}</div>`);
  }
  parts.push(
    '<table class="tfmem-summary">' +
      rows.map(([k, v]) => `<tr><th>${escapeHtml(k)}</th><td>${escapeHtml(v)}</td></tr>`).join('') +
      '</table>'
  );
  const b = report.before;
  if (b) {
    const held =
      b.held === true
        ? 'held'
        : b.held === false
          ? 'missed'
          : b.kernel_changed
            ? 'not judged: the kernel changed'
            : 'not checked';
    parts.push(
      `<div class="tfmem-before-after"><b>Before → after${b.fix_id ? ' (fix ' + escapeHtml(b.fix_id) + ')' : ''}` +
        `: report ${escapeHtml(b.number)}</b><table><tr><th></th><th class="num">before</th><th class="num">after</th></tr>` +
        `<tr><th>TF peak</th><td class="num">${escapeHtml(formatBytes(b.tf_peak_bytes))}</td>` +
        `<td class="num">${escapeHtml(formatBytes(dev ? dev.peak_bytes - dev.baseline_bytes : null))}</td></tr>` +
        (b.predicted_peak_bytes !== null && b.predicted_peak_bytes !== undefined
          ? `<tr><th>prediction</th><td class="num">${escapeHtml(formatBytes(b.predicted_peak_bytes))}</td>` +
            `<td class="num">${held}</td></tr>`
          : '') +
        '</table></div>'
    );
  }
  const t = report.trace;
  if (t && t.events) {
    parts.push(`<h4>At the peak: ${escapeHtml(formatBytes(t.peak_live_bytes))}</h4>`);
    parts.push(`<table class="tfmem-by-phase">${groupRows(t.by_phase, 'phase', t.peak_live_bytes)}</table>`);
    if (t.by_layer && t.by_layer.length) {
      parts.push(`<table class="tfmem-by-layer">${groupRows(t.by_layer, 'layer', t.peak_live_bytes)}</table>`);
    }
  }
  parts.push(heldHtml(view.held));
  parts.push(timelineSvg(report));
  const findings: Json[] = report.findings || [];
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
  const fixes: Json[] = report.fixes || [];
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
