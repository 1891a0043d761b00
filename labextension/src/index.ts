/**
 * tfmem_magic's JupyterLab plugin: the comm target `tfmem_insert` on every notebook kernel (also after a restart
 * or a kernel change). The kernel sends a fix cell's code, the id of the cell that produced the panel and where
 * the fix goes; the plugin inserts the code below that cell (or at the top of the notebook), selects it, never
 * runs it, and acknowledges with where it went.
 */
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { INotebookTracker, NotebookActions, NotebookPanel } from '@jupyterlab/notebook';
import { Kernel, KernelMessage } from '@jupyterlab/services';

import { insertionTarget, parseInsertRequest } from './logic';

export const TARGET = 'tfmem_insert';

/** The notebook whose kernel sent the request (by kernel id: a reconnect makes a new connection object). */
function panelOf(tracker: INotebookTracker, kernel: Kernel.IKernelConnection): NotebookPanel | null {
  let found: NotebookPanel | null = null;
  tracker.forEach(panel => {
    if (!found && panel.sessionContext.session?.kernel?.id === kernel.id) {
      found = panel;
    }
  });
  return found ?? tracker.currentWidget;
}

function insert(panel: NotebookPanel, data: unknown): Record<string, unknown> {
  const request = parseInsertRequest(data);
  if ('error' in request) {
    return { status: 'error', error: request.error };
  }
  const notebook = panel.content;
  const ids = notebook.widgets.map(cell => cell.model.id);
  const target = insertionTarget(ids, request, notebook.activeCellIndex);
  notebook.activeCellIndex = target.index;
  if (target.where === 'above') {
    NotebookActions.insertAbove(notebook);
  } else {
    NotebookActions.insertBelow(notebook);
  }
  notebook.activeCell?.model.sharedModel.setSource(request.code);
  notebook.mode = 'command';
  notebook.activeCell?.node.scrollIntoView({ block: 'nearest' });
  return { status: 'inserted', index: notebook.activeCellIndex, placement: request.placement, found: target.found };
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'tfmem_magic:insert-fix',
  description: 'Inserts tfmem fix cells sent by the kernel',
  autoStart: true,
  requires: [INotebookTracker],
  activate: (app: JupyterFrontEnd, tracker: INotebookTracker) => {
    const seen = new WeakSet<Kernel.IKernelConnection>();
    const register = (kernel: Kernel.IKernelConnection | null | undefined) => {
      if (!kernel || seen.has(kernel)) {
        return;
      }
      seen.add(kernel);
      kernel.registerCommTarget(TARGET, (comm: Kernel.IComm, msg: KernelMessage.ICommOpenMsg) => {
        const panel = panelOf(tracker, kernel);
        const reply = panel ? insert(panel, msg.content.data) : { status: 'error', error: 'notebook not found' };
        comm.send(reply as KernelMessage.ICommMsgMsg['content']['data']);
      });
    };
    tracker.widgetAdded.connect((_, panel) => {
      panel.sessionContext.kernelChanged.connect((_, change) => register(change.newValue));
      void panel.sessionContext.ready.then(() => register(panel.sessionContext.session?.kernel));
    });
  }
};

export default plugin;
