/**
 * Renders application/vnd.tfmem.report+json, so a notebook reopened without its kernel (or an untrusted one, where
 * JupyterLab strips the static HTML's styles) still shows the report: summary, verdict, breakdown at the peak,
 * timeline, findings and fix code. Everything is escaped (safe: true).
 */
import { IRenderMime } from '@jupyterlab/rendermime-interfaces';
import { Widget } from '@lumino/widgets';

import { renderReportHtml } from './logic';

export const MIME_TYPE = 'application/vnd.tfmem.report+json';

class ReportWidget extends Widget implements IRenderMime.IRenderer {
  constructor() {
    super();
    this.addClass('tfmem-mime');
  }

  renderModel(model: IRenderMime.IMimeModel): Promise<void> {
    this.node.innerHTML = renderReportHtml(model.data[MIME_TYPE], model.data['text/plain']);
    return Promise.resolve();
  }
}

const extension: IRenderMime.IExtension = {
  id: 'tfmem_magic:report-renderer',
  description: 'Renders tfmem memory reports',
  rendererFactory: { safe: true, mimeTypes: [MIME_TYPE], createRenderer: () => new ReportWidget() },
  rank: 0,
  dataType: 'json'
};

export default extension;
