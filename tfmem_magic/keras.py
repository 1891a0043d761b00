"""`tfmem_magic.keras.MemoryMonitor`: memory per epoch for `fit`, `evaluate` and `predict`, in scripts and notebooks.

    from tfmem_magic.keras import MemoryMonitor
    monitor = MemoryMonitor()                     # every="batch" or every=100 for finer windows
    history = model.fit(x, y, epochs=5, callbacks=[monitor])
    history.history["tf_peak_bytes"]              # TensorFlow's peak of each epoch; "rss_peak_bytes" too

Importing this module imports Keras (the callback is a Keras Callback), not IPython, and, before TensorFlow's first
op, switches TensorFlow's CPU allocator to BFC (`tfmem_magic.prepare()`), so the monitor sees every allocation.
"""

from __future__ import annotations

from tfmem_magic.adapters.keras_callback import MemoryMonitorMixin, callback_base
from tfmem_magic.measure import environment

__all__ = ["MemoryMonitor"]

# A script typically imports the monitor at the top but creates it after building its tf.data pipeline (TensorFlow's
# first op): switching the CPU allocator to BFC here, at import, makes every allocation visible in that case too.
environment.prepare_allocator()


class MemoryMonitor(MemoryMonitorMixin, callback_base()):  # type: ignore[misc]
    """TensorFlow's and the process's memory peak per epoch (or per N batches), put into the logs as
    `tf_peak_bytes` and `rss_peak_bytes` (put it before a TensorBoard callback in `callbacks` so that one records
    them too). `trace_steps=N` traces the first N steps of the first fit into a full report (`monitor.report`);
    `save=DIR` writes that report (JSON and HTML) there, and every window's figures (`tfmem-epochs.json`) at the
    end of each `fit`, `evaluate` and `predict`. Warns once (`MemoryGrowthWarning`) when the peak grows epoch after
    epoch."""
