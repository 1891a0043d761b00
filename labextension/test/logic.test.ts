import {
  batchText,
  escapeHtml,
  formatBytes,
  insertionTarget,
  parseInsertRequest,
  renderReportHtml,
  timelineSvg
} from '../src/logic';

describe('parseInsertRequest', () => {
  it('reads code, cell id and placement', () => {
    expect(parseInsertRequest({ code: 'x = 1', cell_id: 'abc', placement: 'top' })).toEqual({
      code: 'x = 1',
      cellId: 'abc',
      placement: 'top'
    });
    expect(parseInsertRequest({ code: 'x', cell_id: null })).toEqual({ code: 'x', cellId: null, placement: 'below' });
  });
  it('refuses requests without code', () => {
    expect(parseInsertRequest({ cell_id: 'a' })).toEqual({ error: 'no code to insert' });
    expect(parseInsertRequest(null)).toEqual({ error: 'no data' });
  });
});

describe('insertionTarget', () => {
  const ids = ['a', 'b', 'c'];
  it('goes below the cell that ran', () => {
    expect(insertionTarget(ids, { code: 'x', cellId: 'b', placement: 'below' }, 2)).toEqual({
      index: 1,
      where: 'below',
      found: true
    });
  });
  it('falls back to the active cell when the id is unknown', () => {
    expect(insertionTarget(ids, { code: 'x', cellId: 'zz', placement: 'below' }, 2)).toEqual({
      index: 2,
      where: 'below',
      found: false
    });
    expect(insertionTarget([], { code: 'x', cellId: null, placement: 'below' }, -1)).toEqual({
      index: 0,
      where: 'below',
      found: false
    });
  });
  it('puts restart fixes above the first cell', () => {
    expect(insertionTarget(ids, { code: 'x', cellId: 'c', placement: 'top' }, 2)).toEqual({
      index: 0,
      where: 'above',
      found: true
    });
  });
});

describe('formatBytes', () => {
  it('matches tfmem_magic.core.sizes.format_bytes', () => {
    expect(formatBytes(0)).toBe('0 B');
    expect(formatBytes(812)).toBe('812 B');
    expect(formatBytes(3.4 * 1024)).toBe('3.4 KiB');
    expect(formatBytes(1.25 * 1024 ** 3)).toBe('1.25 GiB');
    expect(formatBytes(640 * 1024 ** 2)).toBe('640 MiB');
    expect(formatBytes(10 * 1024 ** 2)).toBe('10 MiB');
    expect(formatBytes(-2048)).toBe('-2 KiB');
    expect(formatBytes(null)).toBe('n/a');
  });
});

const REPORT = {
  schema: 'tfmem.report/1',
  label: '<b>fit</b>',
  number: 3,
  status: 'ok',
  mode: 'trace',
  wall_s: 1.5,
  view: { verdict: 'fits with 18 GiB to spare', level: 'ok' },
  env: { budget_bytes: 24 * 1024 ** 3, budget_source: 'ram' },
  rss: {
    baseline_bytes: 500 * 1024 ** 2,
    peak_bytes: 700 * 1024 ** 2,
    samples: [
      [0, 1],
      [1, 2]
    ]
  },
  tf: { 'CPU:0': { baseline_bytes: 0, peak_bytes: 64 * 1024 ** 2, end_bytes: 0 } },
  trace: {
    events: 10,
    peak_live_bytes: 64 * 1024 ** 2,
    timeline: [
      [0, 0],
      [0.5, 64 * 1024 ** 2],
      [1, 0]
    ],
    by_phase: [{ phase: 'forward', bytes: 40 * 1024 ** 2 }],
    by_layer: [{ layer: 'dense<script>', bytes: 1 }]
  },
  findings: [{ id: 'large-batch', title: 'The batch', severity: 'warn', evidence: 'a < b' }],
  fixes: [{ id: 'shrink-batch', title: 'Shrink', why: 'why', code: 'model.fit(x, batch_size=8)' }],
  before: {
    number: 1,
    fix_id: 'shrink-batch',
    tf_peak_bytes: 128 * 1024 ** 2,
    predicted_peak_bytes: 60 * 1024 ** 2,
    held: true
  }
};

describe('renderReportHtml', () => {
  const html = renderReportHtml(REPORT);
  it('shows the summary, verdict, breakdown, findings, fixes and before/after', () => {
    expect(html).toContain('class="tfmem-report tfmem-rendered"');
    expect(html).toContain('fits with 18 GiB to spare');
    expect(html).toContain('64 MiB (0 B before + 64 MiB in the cell)');
    expect(html).toContain('At the peak: 64 MiB');
    expect(html).toContain('<pre>model.fit(x, batch_size=8)</pre>');
    expect(html).toContain('%tfmem fix K --report 3');
    expect(html).toContain('Before → after (fix shrink-batch)');
    expect(html).toContain('held');
    expect(html).toContain('<svg class="tfmem-timeline"');
  });
  it('escapes everything that came from the user', () => {
    expect(html).toContain('&lt;b&gt;fit&lt;/b&gt;');
    expect(html).toContain('dense&lt;script&gt;');
    expect(html).toContain('a &lt; b');
    expect(html).not.toContain('<script>');
    expect(escapeHtml('"\'&')).toBe('&quot;&#39;&amp;');
  });
  it('shows who holds memory after the cell, as the Python view words it, escaped', () => {
    const held = {
      headline: 'TensorFlow held 6 MiB more after the cell than before it (6 MiB in all on CPU:0).',
      hint: '%tfmem free NAME ... drops those names and says what TensorFlow gave back.',
      holders: [['models<x>', 'list', '3 Keras models: a, b, c', '6 MiB']]
    };
    const out = renderReportHtml({ ...REPORT, view: { ...REPORT.view, held } });
    expect(out).toContain('<h4>Held after the cell</h4>');
    expect(out).toContain('<code>models&lt;x&gt;</code></td><td>list</td><td>3 Keras models: a, b, c</td>');
    expect(out).toContain('%tfmem free NAME');
    expect(renderReportHtml(REPORT)).not.toContain('Held after the cell');
  });
  it('says so when the data is not a report', () => {
    expect(renderReportHtml({ schema: 'other' })).toContain('Not a tfmem report');
  });
  it('headlines the device the kernel chose (a GPU), not the host allocator', () => {
    const gpu = {
      ...REPORT,
      view: { ...REPORT.view, main_device: 'GPU:0' },
      tf: { ...REPORT.tf, 'GPU:0': { baseline_bytes: 0, peak_bytes: 3 * 1024 ** 3, end_bytes: 0 } }
    };
    expect(renderReportHtml(gpu)).toContain('3 GiB (0 B before + 3 GiB in the cell)');
  });
  it("shows a GPU's own budget beside the host's when the trace gave its limit", () => {
    const gpu = {
      ...REPORT,
      view: { ...REPORT.view, main_device: 'GPU:0' },
      env: { ...REPORT.env, device_limit_bytes: { 'GPU:0': 14 * 1024 ** 3 } },
      tf: { ...REPORT.tf, 'GPU:0': { baseline_bytes: 0, peak_bytes: 3 * 1024 ** 3, end_bytes: 0 } }
    };
    const html = renderReportHtml(gpu);
    expect(html).toContain('<th>GPU:0 budget</th><td>14 GiB (TensorFlow&#39;s allocator limit)</td>');
    expect(html).toContain('<th>Host budget</th><td>24 GiB (ram)</td>');
    expect(renderReportHtml(REPORT)).toContain('<th>Budget</th><td>24 GiB (ram)</td>');
  });
  it("names the global batch and each replica's share, as the kernel does", () => {
    expect(batchText({ batch_size: 256, replicas: 2 })).toBe('256 (128 per replica of 2)');
    expect(batchText({ batch_size: 64 })).toBe('64');
    expect(batchText({})).toBe('?');
    const model = { name: 'm', params: 10, optimizer: 'Adam', batch_size: 256, replicas: 2 };
    expect(renderReportHtml({ ...REPORT, model })).toContain('batch 256 (128 per replica of 2)');
  });
  it('draws no timeline without samples', () => {
    expect(timelineSvg({ rss: { samples: [] } })).toBe('');
  });
});
