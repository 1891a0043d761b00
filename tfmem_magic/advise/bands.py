"""Every band and margin the what-if and the pre-flight judge a prediction with, in one place, one name each.

A band is relative: 0.30 means the true peak is expected within ±30% of the prediction. Each comment says why the
value is what it is and which docs page holds its measurement; the figures themselves are there, not here.
"""

# ---- the what-if's bands, one per basis kind (advise/bases.py) -----------------------------------------------------

# the model's parts alone, no extra run: the analytic basis' misses on the zoo (docs/what-if.md, "Accuracy, measured")
ANALYTIC_BAND = 0.30
# a clone's probes, where they ran (their batches, precision and input size): docs/what-if.md, "The bases"
MEASURED_BAND = 0.10
# a clone's step replay, against the fresh runs' range on both sides of the batch: docs/bfc-replay.md, "Measured"
CLONE_REPLAY_BAND = 0.15
# the cell's own saved step replayed was no closer than the analytic basis on custom steps: docs/bfc-replay.md
OWN_STEP_BAND = ANALYTIC_BAND
# a refused call's whole peak is the pre-flight's replay, not a change from a measured one: docs/preflight.md
PREFLIGHT_ANCHORED_BAND = 0.35

# ---- what a peak is judged with against a budget --------------------------------------------------------------------

# a CPU's process outgrows TF's allocator above the cell's peak: docs/what-if.md, "The budget is the process's"
PROCESS_MARGIN = 0.40

# the share of the profiler's upper estimate taken off what a traced cell grew by outside TensorFlow's allocator when
# a budget is judged: the whole estimate left a GRU's too small (docs/what-if.md, "The budget is the process's")
PROFILER_SHARE_JUDGED = 0.5

# ---- the pre-flight's bands, on what the process grows by in the call: docs/preflight.md, "Accuracy and cost" -------

# the probes' line, the fallback where the replay cannot be used, missed the process's growth by the most, under
PROBE_LINE_BAND = 0.50
# the replay's high end: oneDNN's buffers outside TF's allocator appear at a size threshold the replay cannot see
PREFLIGHT_GROWTH_HIGH = PROCESS_MARGIN
# the replay's low end, which a refusal must pass: the replay was over the process's growth by less than this
PREFLIGHT_GROWTH_LOW = 0.20
# the model's own parts, this many times over, must fit to skip the probes: they miss what recurrent layers keep
MODEL_MARGIN = 3.0

# ---- the allocator's chunks per requested byte, and the trace's moments ---------------------------------------------

# a training step's peak under BFC, where no trace measured it: docs/design.md, 'Allocator statistics and BFC'
TYPICAL_FRAGMENTATION = 1.3
# what a larger batch adds fits its chunks closer than the cell's mix: docs/what-if.md, "Growth in the chunks"
GROWTH_FRAGMENTATION = 1.10
# the trace's busiest moment sets the slope above the batch once it holds this much more: docs/what-if.md, "The bases"
MOMENT_RATIO = 1.2
