/**
 * The renderer on MIME bundles that Python made (tfmem_magic.show.render.mime_bundle):
 * tests/integration/test_labextension.py writes them to a JSON file and runs this suite with TFMEM_BUNDLES naming it
 * (skipped without). Every number the view block words must be on the page, each timeline series must find its
 * points, and nothing may read undefined.
 */
import { readFileSync } from 'fs';

import { escapeHtml, isReport, renderReportHtml } from '../src/logic';

const MIME_TYPE = 'application/vnd.tfmem.report+json';
const file = process.env.TFMEM_BUNDLES;
const bundles: Record<string, Record<string, unknown>> = file ? JSON.parse(readFileSync(file, 'utf8')) : {};

(file ? describe : describe.skip)('bundles made by Python', () => {
  it('were given', () => {
    expect(Object.keys(bundles).length).toBeGreaterThan(0);
  });
  for (const [name, bundle] of Object.entries(bundles)) {
    it(`renders ${name} with the words of its view block`, () => {
      const data = bundle[MIME_TYPE];
      expect(isReport(data)).toBe(true);
      if (!isReport(data) || !data.view) {
        return;
      }
      const view = data.view;
      const html = renderReportHtml(data, bundle['text/plain']);
      expect(html).toContain('class="tfmem-report tfmem-rendered"');
      expect(html).not.toContain('Saved by an older tfmem_magic');
      const words: string[] = [view.verdict, ...(view.summary ?? []).flat(), ...(view.before_after ?? []).flat()];
      if (view.model) {
        words.push(view.model);
      }
      if (view.error_site) {
        words.push(view.error_site);
      }
      if (view.peak) {
        words.push(view.peak.heading, ...[...view.peak.by_phase, ...view.peak.by_layer].map(r => r.bytes));
        for (const row of view.peak.by_line ?? []) {
          words.push(row.label, row.code, row.bytes, row.split, row.largest, row.made_by, row.made_by_code);
        }
        if (view.peak.by_line_note) {
          words.push(view.peak.by_line_note);
        }
      }
      for (const s of view.timeline ?? []) {
        words.push(`${s.name}: ${s.low} → ${s.high} over ${s.seconds}`);
      }
      if (view.held) {
        words.push(view.held.headline, ...view.held.holders.flat());
        for (const row of view.held.by_line ?? []) {
          words.push(row.label, row.code, row.bytes, row.split, row.largest, row.made_by, row.made_by_code);
        }
        if (view.held.by_line_note) {
          words.push(view.held.by_line_note);
        }
      }
      for (const word of words) {
        expect(html).toContain(escapeHtml(word));
      }
      expect((html.match(/<svg class="tfmem-timeline"/g) ?? []).length).toBe((view.timeline ?? []).length);
      for (const wrong of ['undefined', 'NaN', '[object Object]']) {
        expect(html).not.toContain(wrong);
      }
    });
  }
});
