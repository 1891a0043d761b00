"""Measuring a cell: the allocator's counters, process memory, the profiler trace, Keras call spans, the guard."""
