import {
  escapeHtml,
  insertionTarget,
  isReport,
  parseInsertRequest,
  renderReportHtml,
  ReportBundle,
  timelineSvg
} from '../src/logic';

/** A partial report as a test writes it (tests/integration/test_labextension.py renders complete ones from Python). */
const bundle = (data: object): ReportBundle => data as ReportBundle;

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

const REPORT = {
  schema: 'tfmem.report/1',
  label: '<b>fit</b>',
  number: 3,
  status: 'ok',
  mode: 'trace',
  wall_s: 1.5,
  view: {
    verdict: 'fits with 18 GiB to spare',
    level: 'ok',
    main_device: 'CPU:0',
    summary: [
      ['TF peak (CPU:0)', '64 MiB', '0 B before + 64 MiB in the cell; 0 B held after'],
      ['Budget left', '18 GiB', 'of 24 GiB (available RAM)'],
      ['Time', '1.50 s', 'ok · trace mode']
    ],
    before_after: [
      ['TF peak (in the cell)', '128 MiB', '64 MiB'],
      ['prediction ±15%', '60 MiB', '64 MiB: held']
    ],
    peak: {
      heading: 'At the peak: 64 MiB live at t = 0.500 s',
      by_phase: [{ label: 'forward', bytes: '40 MiB', share: 0.625 }],
      by_layer: [{ label: 'dense<script>', bytes: '1 B', share: 0 }]
    },
    timeline: [
      { kind: 'trace', name: 'TF live bytes (trace)', from_zero: true, low: '0 B', high: '64 MiB', seconds: '1.00 s' },
      { kind: 'rss', name: 'process RSS', from_zero: false, low: '1 B', high: '2 B', seconds: '1.00 s' }
    ]
  },
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
    expect(html).toContain(
      '<tr><th>TF peak (CPU:0)</th><td>64 MiB <span class="tfmem-muted">0 B before + 64 MiB in the cell; ' +
        '0 B held after</span></td></tr>'
    );
    expect(html).toContain('<h4>At the peak: 64 MiB live at t = 0.500 s</h4>');
    expect(html).toContain(
      '<td>forward</td><td class="num">40 MiB</td><td><span class="tfmem-bar" style="width:100px">'
    );
    expect(html).toContain('<pre>model.fit(x, batch_size=8)</pre>');
    expect(html).toContain('%tfmem fix K --report 3');
    expect(html).toContain('Before → after (fix shrink-batch): report 1');
    expect(html).toContain('<th>prediction ±15%</th><td class="num">60 MiB</td><td class="num">64 MiB: held</td>');
    expect(html).toContain('<svg class="tfmem-timeline"');
    expect(html).toContain('TF live bytes (trace): 0 B → 64 MiB over 1.00 s');
  });
  it('formats no number itself: the words are the view block', () => {
    const view = { ...REPORT.view, summary: [['Time', 'ONE', 'TWO']], model: 'm: 10 params, batch 256 (128 per ...)' };
    const out = renderReportHtml({ ...REPORT, view });
    expect(out).toContain('<th>Time</th><td>ONE <span class="tfmem-muted">TWO</span>');
    expect(out).toContain('<tr><th>Model</th><td>m: 10 params, batch 256 (128 per ...)</td></tr>');
    expect(out).not.toContain('TF peak (CPU:0)');
  });
  it('escapes everything that came from the user', () => {
    expect(html).toContain('&lt;b&gt;fit&lt;/b&gt;');
    expect(html).toContain('dense&lt;script&gt;');
    expect(html).toContain('a &lt; b');
    expect(html).not.toContain('<script>');
    expect(escapeHtml('"\'&')).toBe('&quot;&#39;&amp;');
    const evil = renderReportHtml({ ...REPORT, view: { ...REPORT.view, summary: [['<i>', '<b>', '<u>']] } });
    expect(evil).toContain('<th>&lt;i&gt;</th><td>&lt;b&gt; <span class="tfmem-muted">&lt;u&gt;</span>');
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
  it('shows the lines of code that made what the cell left live under Held after, escaped', () => {
    const row = {
      label: 'In [2] line 3',
      code: "keep.append('<script>alert(1)</script>' & y)",
      bytes: '4 MiB',
      share: 0.5,
      split: '',
      largest: 'largest: float32[1024,1024] RandomStandardNormal 4 MiB',
      made_by: '',
      made_by_code: ''
    };
    const note = '4 MiB of the 8 MiB the cell left live named by a line of code; not by a line: eager ops 4 MiB';
    const held = { headline: 'TensorFlow held 8 MiB more after the cell than before it.', hint: null, holders: [] };
    const out = renderReportHtml({
      ...REPORT,
      view: { ...REPORT.view, held: { ...held, by_line: [row], by_line_note: note } }
    });
    const section = out.split('<h4>Held after the cell</h4>')[1];
    expect(section).toContain(
      '<b>By line</b>: what the cell left live at its end, by the line of code that made it<table class="tfmem-by-line">'
    );
    expect(section).toContain(
      '<td>In [2] line 3</td><td><code>keep.append(&#39;&lt;script&gt;alert(1)&lt;/script&gt;&#39; &amp; y)</code></td>' +
        '<td class="num">4 MiB</td><td><span class="tfmem-bar" style="width:80px">'
    );
    expect(section).toContain('largest: float32[1024,1024] RandomStandardNormal 4 MiB');
    expect(section).toContain(note);
    expect(section).not.toContain('tfmem-holders'); // no name holds it: no holders table
    expect(out).not.toContain('<script>');
    const unnamed = renderReportHtml({ ...REPORT, view: { ...REPORT.view, held: { ...held, by_line: [] } } });
    expect(unnamed).toContain('No line of code made what the cell left live at its end.');
    // a trace that stopped early, or a bundle from an older tfmem_magic: no lines, and nothing held, no section
    expect(renderReportHtml({ ...REPORT, view: { ...REPORT.view, held } })).not.toContain('Held after the cell');
  });
  it('shows the lines of code that made the peak, their code as code, escaped', () => {
    const peak = {
      ...REPORT.view.peak,
      by_line: [
        {
          label: 'In [2] line 5',
          code: "x = '<script>alert(1)</script>' & y",
          bytes: '12 MiB',
          share: 0.5,
          split: 'forward 8 MiB, backward 4 MiB',
          largest: 'largest of 3 tensors: float32[256,8192] MatMul 8 MiB',
          made_by: 'layer wide made at In [3] line 1',
          made_by_code: 'model = keras.Sequential([Wide(), <Dense>])'
        },
        {
          label: 'In [3] line 1',
          code: '',
          bytes: '8 MiB',
          share: 0.25,
          split: '',
          largest: '',
          made_by: '',
          made_by_code: ''
        }
      ],
      by_line_note: '20 MiB of the 24 MiB traced at the peak named by a line of code; not by a line: eager ops 4 MiB'
    };
    const out = renderReportHtml({ ...REPORT, view: { ...REPORT.view, peak } });
    expect(out).toContain('<table class="tfmem-by-line">');
    expect(out).toContain(
      '<td>In [2] line 5</td><td><code>x = &#39;&lt;script&gt;alert(1)&lt;/script&gt;&#39; &amp; y</code></td>' +
        '<td class="num">12 MiB</td><td><span class="tfmem-bar" style="width:80px">'
    );
    expect(out).toContain(
      'forward 8 MiB, backward 4 MiB · largest of 3 tensors: float32[256,8192] MatMul 8 MiB · ' +
        'layer wide made at In [3] line 1: <code>model = keras.Sequential([Wide(), &lt;Dense&gt;])</code>'
    );
    expect(out).toContain('<td>In [3] line 1</td><td></td><td class="num">8 MiB</td>');
    expect(out.match(/tfmem-line-detail/g) ?? []).toHaveLength(1); // a row with nothing more has no second row
    expect(out).toContain('not by a line: eager ops 4 MiB');
    expect(out).not.toContain('<script>');
    const none = renderReportHtml({ ...REPORT, view: { ...REPORT.view, peak: { ...peak, by_line: [] } } });
    expect(none).toContain('No line of code made what was live at the peak.');
    expect(html).not.toContain('By line'); // a report without a by-line view (quick mode, an older bundle)
  });
  it("shows an OOM's line of code as the Python view words it, escaped", () => {
    const site = 'requested by In [2] line 3: x = f(<y>)';
    const out = renderReportHtml({ ...REPORT, view: { ...REPORT.view, error_site: site } });
    expect(out).toContain(`<tr><th>Failed at</th><td>${escapeHtml(site)}</td></tr>`);
    expect(html).not.toContain('Failed at');
  });
  it('says so when the data is not a report', () => {
    expect(renderReportHtml({ schema: 'other' })).toContain('Not a tfmem report');
    expect(renderReportHtml(null)).toContain('Not a tfmem report');
    expect(isReport(REPORT)).toBe(true);
  });
  it('shows the text form of a bundle saved by a tfmem_magic without the view numbers', () => {
    const old = { ...REPORT, view: { verdict: 'fits', level: 'ok', main_device: 'CPU:0' } };
    const out = renderReportHtml(old, 'tfmem · fit\nTF        CPU:0 peak 64 MiB <x>');
    expect(out).toContain('class="tfmem-report tfmem-rendered"');
    expect(out).toContain('<div class="tfmem-verdict tfmem-ok">fits</div>');
    expect(out).toContain('Saved by an older tfmem_magic');
    expect(out).toContain('<pre class="tfmem-text">tfmem · fit\nTF        CPU:0 peak 64 MiB &lt;x&gt;</pre>');
    expect(renderReportHtml({ schema: 'tfmem.report/1' })).toContain('<pre class="tfmem-text"></pre>');
  });
  it("draws a sampled device's live bytes when there is no trace", () => {
    const sampled = bundle({
      ...REPORT,
      trace: null,
      tf: {
        'GPU:1': {
          samples: [
            [0, 0],
            [2, 5]
          ]
        }
      },
      view: {
        ...REPORT.view,
        timeline: [
          {
            kind: 'device',
            device: 'GPU:1',
            name: 'TF live bytes (sampled, GPU:1)',
            from_zero: true,
            low: '0 B',
            high: '5 B',
            seconds: '2.00 s'
          }
        ]
      }
    });
    const svg = timelineSvg(sampled);
    expect(svg).toContain('TF live bytes (sampled, GPU:1): 0 B → 5 B over 2.00 s');
    expect(svg).toContain('<path d="M0.0,59.0L600.0,1.0"');
  });
  it('draws no timeline without samples', () => {
    expect(timelineSvg(bundle({ rss: { samples: [] } }))).toBe('');
    expect(timelineSvg(bundle({ ...REPORT, trace: null, rss: { samples: [] } }))).toBe('');
  });
});
