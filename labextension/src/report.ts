/**
 * GENERATED FILE, do not edit: made by `npm run types` (scripts/types.mjs, json-schema-to-typescript) from
 *   tfmem_magic/report.schema.json (the report: Report)
 *   labextension/schema/view.schema.json (the bundle's view block: ReportView)
 * After a schema changed, run `cd labextension && npm run types`: tests/integration/test_labextension.py fails
 * until then.
 */

/**
 * tfmem report (tfmem.report/1): One measured cell (or block, or saved trace): what every surface of tfmem renders. Bytes are integers and times seconds; keys are added freely and never renamed without a new schema id (docs/design.md, 'Report contract').
 */
export interface Report {
  label: string;
  status: string;
  error: ErrorInfo | null;
  mode: string;
  wall_s: number;
  env: EnvInfo;
  rss: RssInfo;
  tf: {
    [k: string]: DeviceMemory | undefined;
  };
  trace: TraceInfo | null;
  model: ModelInfo | null;
  findings: Finding[];
  fixes: Fix[];
  prediction: Prediction | null;
  whatif_basis: Basis | null;
  guard: GuardInfo | null;
  preflight: PreflightInfo | null;
  held: HeldInfo | null;
  calls: CallRecord[];
  before: BeforeAfter | null;
  number: number;
  cell_key: string | null;
  run: number;
  tf_function_traces: {
    [k: string]: number | undefined;
  };
  tf_function_signatures: {
    [k: string]: number | undefined;
  };
  notes: string[];
  started_at: number;
  schema: 'tfmem.report/1';
}
export interface ErrorInfo {
  type: string;
  message: string;
  request: {
    [k: string]: unknown | undefined;
  } | null;
  site: ErrorSite | null;
}
/**
 * The line of the user's code that made an OOM's failing request (analyze/lines.py `error_site`, docs/lines.md). A graph op is named from the stack TensorFlow kept for its node, as the by-line view names it; an eager op (or a graph op whose node was not found) from the innermost frame of the user's code in the error's traceback (`via`).
 */
export interface ErrorSite {
  label: string;
  code: string | null;
  file: string | null;
  line: number | null;
  via: string;
  layer: string | null;
  made_by: string | null;
}
export interface EnvInfo {
  tensorflow: string | null;
  keras: string | null;
  keras_package: string;
  python: string;
  platform: string;
  allocator: string;
  allocator_complete: boolean;
  allocator_note: string | null;
  devices: string[];
  ram_total_bytes: number;
  ram_available_bytes: number;
  cgroup_limit_bytes: number | null;
  budget_bytes: number;
  budget_source: string;
  mixed_precision_policy: string | null;
  device_limit_bytes: {
    [k: string]: number | undefined;
  };
  tensorflow_started_in_cell: boolean;
}
export interface RssInfo {
  baseline_bytes: number;
  peak_bytes: number;
  end_bytes: number;
  peak_source: string;
  samples: number[][];
}
export interface DeviceMemory {
  baseline_bytes: number;
  peak_bytes: number;
  end_bytes: number;
  samples: number[][];
  peak_before_bytes: number | null;
  lifetime_peak_bytes: number | null;
}
export interface TraceInfo {
  events: number;
  peak_live_bytes: number;
  peak_requested_bytes: number;
  peak_time_s: number;
  timeline: number[][];
  preexisting_bytes: number;
  allocated_at_peak_bytes: number;
  requested_at_peak_bytes: number;
  at_peak: LiveGroup[];
  by_layer: LiveGroup[];
  by_op: LiveGroup[];
  by_phase: LiveGroup[];
  input_copies: InputCopy[];
  allocator: string | null;
  allocators: AllocatorUse[];
  covered_s: number;
  windows: number[][];
  complete: boolean;
  budget_spent: boolean;
  profiler_bytes: number;
  profiler_rss_bytes: number;
  batch_bytes_at_peak: number | null;
  replica_batch_size: number | null;
  batch_bytes_most: number | null;
  live_at_batch_most_bytes: number | null;
  moments_below: number[][];
  xla_runs: number;
  xla_at_peak_bytes: number;
  held_at_end: LiveGroup[];
  held_at_end_bytes: number;
  note: string | null;
  by_line: LineGroup[];
  by_line_named_bytes: number;
  by_line_note: string | null;
  held_at_end_by_line: LineGroup[];
}
/**
 * Bytes live at the peak moment, grouped by one or more keys (op, layer, phase, dtype, shape).
 */
export interface LiveGroup {
  op: string | null;
  layer: string | null;
  phase: string | null;
  bytes: number;
  requested_bytes: number;
  count: number;
  dtype: string | null;
  shape: string | null;
}
/**
 * A whole array handed to fit/evaluate/predict, copied into a tensor (Keras does this for numpy inputs).
 */
export interface InputCopy {
  bytes: number;
  requested_bytes: number;
  start_s: number;
  end_s: number | null;
  live_at_peak: boolean;
  role: string;
}
/**
 * One of the trace's allocators (a GPU trace has one per GPU, plus pinned host memory): the breakdown is about the first, the main device's; the others are listed, never mixed in.
 */
export interface AllocatorUse {
  name: string;
  device: string | null;
  events: number;
  peak_bytes: number;
  limit_bytes: number | null;
  timeline: number[][];
}
/**
 * Bytes live at the peak (or still live when the trace ended: `TraceInfo.held_at_end_by_line`), grouped by the line of the user's code that made them (analyze/lines.py, docs/lines.md). Bytes no line made are grouped under what they are (`kind`), never under a guessed line.
 */
export interface LineGroup {
  label: string;
  kind: string;
  code: string | null;
  file: string | null;
  line: number | null;
  bytes: number;
  requested_bytes: number;
  forward_bytes: number;
  backward_bytes: number;
  count: number;
  layer: string | null;
  made_by: string | null;
  made_by_code: string | null;
  tensors: LineTensor[];
}
/**
 * One of the largest tensors a line of code had live at the peak.
 */
export interface LineTensor {
  bytes: number;
  shape: string | null;
  dtype: string | null;
  op: string | null;
  phase: string | null;
}
export interface ModelInfo {
  name: string;
  params: number;
  trainable_params: number;
  param_bytes: number;
  optimizer: string | null;
  optimizer_slots: number;
  optimizer_bytes: number;
  batch_size: number | null;
  input_shape: string | null;
  dtype_policy: string | null;
  calls: string[];
  layers: LayerInfo[];
  trainable_bytes: number;
  samples: number | null;
  input_array_bytes: number;
  new_weight_bytes: number;
  optimizer_built_in_cell: boolean;
  batch_source: string | null;
  feed: string;
  validation: string | null;
  input_copy_bytes: number;
  validation_copy_bytes: number;
  other_models: string[];
  keras_package: string;
  jit_compile: boolean;
  replicas: number;
  optimizers: string[];
}
export interface LayerInfo {
  name: string;
  type: string;
  params: number;
  output_shape: string | null;
  activation_bytes_per_sample: number;
  kept_bytes_per_sample: number;
  input_bytes_per_sample: number;
}
export interface Finding {
  id: string;
  title: string;
  severity: string;
  evidence: string;
  bytes: number | null;
  fixes: string[];
  holders: string[];
}
export interface Fix {
  id: string;
  title: string;
  why: string;
  code: string;
  predicted_peak_bytes: number | null;
  needs_restart: boolean;
  placement: string;
}
export interface Prediction {
  basis: string;
  static_bytes: number;
  per_sample_bytes: number;
  fragmentation_ratio: number;
  error_band: number;
}
/**
 * How the cell's peak splits, in requested bytes, at the cell's own settings: what the what-if predicts from (advise/prediction.py). Stored on the report (`Report.whatif_basis`), so a saved report predicts as the live one.
 */
export interface Basis {
  name: string;
  weights: number;
  gradients: number;
  optimizer: number;
  input_copy: number;
  activations_per_sample: number;
  input_per_sample: number;
  other: number;
  fragmentation: number;
  measured_peak: number | null;
  knobs: Knobs;
  calibration: {
    [k: string]: unknown | undefined;
  };
  activations_per_sample_below: number | null;
  moment_gap: number;
  lines_below: number[][];
  slope_source: string;
  copy_missing: number;
  increment_fragmentation: number | null;
  growth_fragmentation: number | null;
  replay: ReplayCurve | null;
  anchor: string;
}
/**
 * The settings a what-if changes (advise/prediction.py, predict).
 */
export interface Knobs {
  batch_size: number;
  policy: string;
  optimizer: string | null;
  accumulation_steps: number;
  input_scale: number;
  replicas: number;
}
/**
 * The step replay (analyze/step_replay.py): the model's allocation sequence, traced from a fresh allocator at two odd probe batches, replayed through the BFC simulator at a grid of batches. Stored with the basis, so a saved report predicts as the live one; advise/prediction.py interpolates it and anchors it on the cell's peak.
 */
export interface ReplayCurve {
  probes: number[];
  events: number;
  allocations: number;
  aligned: number;
  own_error: number;
  cross_error: number;
  traced_peaks: number[];
  batches: number[];
  peaks: number[];
  second_peaks: number[];
  region_peaks: number[];
  passed: boolean;
  why_not: string;
  seconds: number;
  retried: boolean;
  source: string;
  scaled: number;
  negligible: number;
  sized: number;
  summed: boolean;
  convolves: boolean | null;
}
/**
 * The memory limit in force for the cell, and what enforced it (see guard.py).
 */
export interface GuardInfo {
  limit_bytes: number;
  source: string;
  layers: string[];
  allocator_limit_bytes: number | null;
  tripped_by: string | null;
  tripped_rss_bytes: number | null;
}
/**
 * The pre-flight of a fit/evaluate/predict under a memory limit: a clone of the model ran its steps at two small batches in another process, and the step replay of their allocations (or, where it could not be used, the line through their peaks) predicted the call's step at its own batch.
 */
export interface PreflightInfo {
  call: string;
  batch_size: number;
  probe_batches: number[];
  step_bytes: number;
  extra_bytes: number;
  rss_bytes: number;
  predicted_rss_bytes: number;
  threshold_bytes: number;
  band: number;
  band_below: number;
  verdict: string;
  basis: string;
  replay_note: string;
  fed_note: string;
  kept: boolean;
  own_step: string;
  largest_batch: number | null;
  restart_batch: number | null;
  seconds: number;
  tf_bytes: number;
  reusable_bytes: number;
  floor_bytes: number;
  replay: ReplayCurve | null;
  by_line: LineGroup[];
  gpu: GpuPreflight | null;
}
/**
 * The pre-flight's judgement of the GPU a call's steps run on: its probes ran on the CPU (they never need the GPU the kernel holds), and their step is modelled for the GPU as `predict(report, gpu=...)` models a CPU report (advise/gpu_target.py): the step's tensors, and a whole cuDNN workspace cap beside them for "fits".
 */
export interface GpuPreflight {
  device: string;
  limit_bytes: number;
  in_use_bytes: number;
  workspace_cap_bytes: number;
  convolves: boolean;
  conv_io_bytes_per_sample: number;
  extra_bytes: number;
  model_known: boolean;
  step_bytes: number;
  verdict: string;
  largest_batch: number | null;
}
/**
 * What TensorFlow still held when the cell ended, and who holds it.
 */
export interface HeldInfo {
  left_bytes: number | null;
  holders: Holder[];
  runtime_bytes: number;
  runtime_entries: number;
  runtime_new_bytes: number;
  complete: boolean;
}
/**
 * A name in the user's namespace that keeps TensorFlow memory alive (measure/holders.py).
 */
export interface Holder {
  name: string;
  kind: string;
  bytes: number;
  new_bytes: number;
  models: string[];
  model_bytes: number[];
  tensors: number;
  variables: number;
  paths: string[];
  shared_with: string[];
}
/**
 * One fit/evaluate/predict/…_on_batch call of the cell (not the calls Keras nests in it), with what it left.
 */
export interface CallRecord {
  call: string;
  model: string | null;
  start_s: number;
  end_s: number;
  tf_before_bytes: number | null;
  tf_after_bytes: number | null;
  rss_before_bytes: number;
  rss_after_bytes: number;
  output_bytes: number;
}
/**
 * A fix cell's report compared with the report it fixes (`%%tfmem --before N --fix ID`).
 */
export interface BeforeAfter {
  number: number;
  label: string;
  status: string;
  tf_peak_bytes: number | null;
  rss_peak_bytes: number;
  wall_s: number;
  fix_id: string | null;
  predicted_peak_bytes: number | null;
  error_band: number | null;
  held: boolean | null;
  kernel_changed: string | null;
}

/**
 * @minItems 3
 * @maxItems 3
 */
export type SummaryRow = [string, string, string];
/**
 * @minItems 3
 * @maxItems 3
 */
export type BeforeAfterRow = [string, string, string];
/**
 * @minItems 4
 * @maxItems 4
 */
export type HolderRow = [string, string, string, string];

/**
 * tfmem report view: The `view` block that tfmem_magic.show.render.mime_bundle adds to the report in the application/vnd.tfmem.report+json bundle (render.lab_view): what the JupyterLab renderer shows, worded and formatted by the Python views, so that the renderer formats no number itself. A bundle saved by an older tfmem_magic may lack any key but verdict and level. tests/integration/test_labextension.py checks Python's blocks against this schema; after changing it, run `npm run types`.
 */
export interface ReportView {
  /**
   * one line a person reads in two seconds
   */
  verdict: string;
  /**
   * the verdict's colour
   */
  level: 'ok' | 'warn' | 'bad';
  /**
   * the TF device the headline numbers are about
   */
  main_device?: string | null;
  /**
   * the headline numbers: (label, value, detail), as show/view.py summary_items words them
   */
  summary?: SummaryRow[];
  /**
   * the model in one line: name, parameters, optimizer, batch
   */
  model?: string;
  /**
   * an OOM's line of code that made the failing request (show/view.py error_site_text); absent without one
   */
  error_site?: string;
  /**
   * (what, before, after) rows comparing this cell with the report it re-ran (render.before_after_rows)
   */
  before_after?: BeforeAfterRow[];
  peak?: PeakView;
  /**
   * the timeline's series with two points or more, as figures.timeline_figure picks them
   */
  timeline?: TimelineSeries[];
  held?: HeldView;
}
/**
 * what was live at the trace's peak
 */
export interface PeakView {
  heading: string;
  by_phase: PeakRow[];
  by_layer: PeakRow[];
  /**
   * the lines of code that made the most of it (show/view.py by_line_rows); absent without a by-line view (quick mode, a saved trace, an older tfmem_magic)
   */
  by_line?: LineRow[];
  /**
   * how much a line of code named, and what no line made (TraceInfo.by_line_note)
   */
  by_line_note?: string | null;
}
export interface PeakRow {
  label: string;
  /**
   * the bytes in words (format_bytes)
   */
  bytes: string;
  /**
   * the row's part of the peak, 0 to 1 (the bar's width)
   */
  share: number;
}
/**
 * one line of code, in the words of show/view.py LineRow
 */
export interface LineRow {
  /**
   * "In [2] line 5", "train.py:12"
   */
  label: string;
  /**
   * the line's text, empty where it was not found
   */
  code: string;
  /**
   * the bytes in words (format_bytes)
   */
  bytes: string;
  /**
   * the line's part of the peak, 0 to 1 (the bar's width)
   */
  share: number;
  /**
   * forward and backward bytes in words, or empty
   */
  split: string;
  /**
   * its largest tensor in words, or empty
   */
  largest: string;
  /**
   * a layer's line: the line that made the layer, or empty
   */
  made_by: string;
  /**
   * the text of the line that made the layer, or empty
   */
  made_by_code: string;
}
export interface TimelineSeries {
  /**
   * where the points are: trace.timeline, tf[device].samples or rss.samples
   */
  kind: 'trace' | 'device' | 'rss';
  device?: string;
  name: string;
  /**
   * the y axis starts at 0, else at the lowest point
   */
  from_zero: boolean;
  /**
   * the y axis' bottom in words
   */
  low: string;
  /**
   * the y axis' top in words
   */
  high: string;
  /**
   * the time axis' length in words (shared by the series)
   */
  seconds: string;
}
/**
 * who holds TensorFlow memory at the cell's end, and what the cell left live (show/view.py held_view)
 */
export interface HeldView {
  headline: string;
  hint: string | null;
  /**
   * (name, what it is, what it holds, bytes)
   */
  holders: HolderRow[];
  /**
   * the lines of code that made the most of what the cell left live (show/view.py by_line_rows, end=True); absent where the trace did not cover the whole cell or resolved no lines
   */
  by_line?: LineRow[];
  /**
   * how much of it a line of code named, and what no line made (show/view.py held_by_line_note)
   */
  by_line_note?: string | null;
}
