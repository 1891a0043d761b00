"""The batch that fits, as the large-batch finding and the shrink-batch fix both name it.

One answer for both, so that a report never names two: the pre-flight's where it measured the call (it refused the
batch, or let it run and the cell then ran out), else the report's what-if (its basis and margin), and never a
batch at or above one that has just run out of memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from tfmem_magic.advise.prediction import predict, typeable_batch
from tfmem_magic.core.report import Report
from tfmem_magic.core.sizes import format_bytes


@dataclass
class FittingBatch:
    batch: int
    source: str  # "preflight" | "whatif" | "half" (ran out although the what-if said it fits)
    why: str  # how it was chosen, as a clause: "the largest batch whose ... fits the ... left"
    band: float  # the margin it was judged with: its prediction's band, or the pre-flight's
    basis: str  # that prediction's basis: "preflight" or the what-if's ("analytic", "measured", "replay")

    def sentence(self) -> str:
        """The finding's words for it."""
        if self.source == "whatif":
            return (
                f"The largest batch predicted to fit (with a {self.band:.0%} margin, {self.basis} basis) is "
                f"{self.batch}."
            )
        return f"The batch to try is {self.batch}, {self.why}."


def fitting_batch(report: Report, budget: int) -> FittingBatch | None:
    """The batch to name for a cell under `budget` (what TF's peak may reach, `budget_for_tf`); None when even
    batch 1 is predicted not to fit, or (after an OOM) no smaller batch its replicas can share is left."""
    model = report.model
    assert model is not None and model.batch_size
    batch = model.batch_size
    pre = report.preflight
    if (
        pre is not None
        and pre.batch_size == batch
        and pre.largest_batch
        and (pre.verdict == "refused" or (report.stopped_for_memory and pre.largest_batch < batch))
    ):
        # the pre-flight measured the clone's steps and predicted the process, outside TF's allocator too
        return FittingBatch(
            pre.largest_batch,
            "preflight",
            f"the largest batch whose pre-flight prediction (+{pre.band:.0%}) fits the "
            f"{format_bytes(pre.threshold_bytes)} the guard allows",
            pre.band,
            "preflight",
        )
    now = predict(report, tf_budget=budget)
    fit = now.largest_batch
    if fit is None:
        return None
    if report.stopped_for_memory and fit >= batch:
        half = typeable_batch(batch // 2, max(1, model.replicas))  # a batch the replicas can share
        if half >= batch:
            return None  # no smaller batch the replicas can share
        return FittingBatch(
            half,
            "half",
            f"half the batch: the cell ran out of memory although the predicted peak "
            f"fits the {format_bytes(budget)} left, so the prediction is not to be "
            "trusted here",
            now.error_band,
            now.basis,
        )
    # the margin the search judged that batch with (+40% above the cell's peak on a CPU; below the cell's batch a
    # calibrated band that spans the analytic one's high end: prediction.judged_band)
    margin = predict(report, tf_budget=budget, batch_size=max(1, fit)).fit_margin
    return FittingBatch(
        max(1, fit),
        "whatif",
        f"the largest batch whose predicted peak (+{margin:.0%} margin, {now.basis} basis) "
        f"fits the {format_bytes(budget)} left",
        margin,
        now.basis,
    )
