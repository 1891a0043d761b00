"""Open dimensions (docs/preflight.md, 'Open dimensions'): a padded pipeline's lengths are read from its batches,
dimension by dimension the longest; the probes never make one up, and the model's own parts never vouch for a step
whose layer outputs have an unknown size."""

import pytest

from tfmem_magic.advise import preflight, probe_runs
from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.measure import fed_shapes
from tfmem_magic.measure.feeding import LEAF


def leaf(*dims, dtype="int64"):
    return {LEAF: [list(dims), dtype]}


SPEC = {"x": leaf(None), "y": leaf(None), "sample_weight": None}  # padded_batch's element_spec


def test_the_widest_of_two_batches_and_the_spec_filled_from_it():
    short, long = {"x": leaf(12), "y": leaf(12)}, {"x": leaf(200), "y": leaf(200)}
    seen = fed_shapes.widest(fed_shapes.widest(None, short), long)
    assert seen == {"x": leaf(200), "y": leaf(200)}
    assert fed_shapes.has_open_dims(SPEC) and not fed_shapes.has_open_dims(seen)
    full = fed_shapes.filled(SPEC, seen)
    assert full == {"x": leaf(200), "y": leaf(200), "sample_weight": None}
    assert fed_shapes.filled({"x": leaf(None, 8)}, {"x": leaf(30, 8)}) == {"x": leaf(30, 8)}  # known dims stay


class Batches:
    """A pipeline of (x, y) batches with these lengths (arrays: shaped as tf.data yields tensors)."""

    def __init__(self, lengths):
        self.lengths = lengths

    def __iter__(self):
        import numpy as np

        return iter([(np.zeros((4, n), "int64"), np.zeros((4, n), "int64")) for n in self.lengths])


def test_a_scan_to_the_end_knows_the_longest_and_one_cut_short_a_lower_bound():
    whole = fed_shapes.scan(Batches([7, 200, 31]), SPEC)
    assert whole.exact and whole.batches == 3 and whole.longest == [200, 200]
    cut = fed_shapes.scan(Batches([7, 31, 200]), SPEC, limit=2)
    assert not cut.exact and cut.longest == [31, 31]
    info = preflight._lower_bound_only(preflight.PreflightInfo(call="fit", batch_size=4, verdict="fits"), cut)
    assert info.verdict == "uncertain" and "first 2 batches" in info.fed_note  # never "fits" on a lower bound
    refused = preflight._lower_bound_only(preflight.PreflightInfo(call="fit", batch_size=4, verdict="refused"), cut)
    assert refused.verdict == "refused"


def test_a_layer_output_of_unknown_length_is_no_evidence_that_a_step_fits():
    assert preflight._open_output("(None, None, 32)") and preflight._open_output(None)
    assert not preflight._open_output("(None, 40, 32)") and not preflight._open_output("[(None, 4), (None, 5)]")


class NoInputs:
    inputs = None  # a subclassed model: no symbolic inputs to fix a length


class FixedLength:
    class Input:
        shape = (None, 128)

    inputs = [Input()]


def test_the_probes_never_make_up_a_length():
    with pytest.raises(TfmemUsageError, match="padded or ragged"):
        probe_runs.lengths_known(NoInputs(), SPEC)
    probe_runs.lengths_known(FixedLength(), {"x": leaf(None), "y": leaf(10)})  # the model's input fixes it
    with pytest.raises(TfmemUsageError, match="padded or ragged"):  # the targets' length is still open
        probe_runs.lengths_known(FixedLength(), {"x": leaf(None), "y": leaf(None)})
    probe_runs.lengths_known(NoInputs(), {"x": leaf(40), "y": leaf(40)})
