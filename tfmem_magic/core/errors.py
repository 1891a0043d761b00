"""One base exception for the package; usage errors carry the fix in their message."""


class TfmemError(Exception):
    """Base class of every error tfmem_magic raises on purpose."""


class TfmemUsageError(TfmemError, ValueError):
    """Bad arguments or options; the message says what to write instead.

    The IPython adapter turns it into IPython's UsageError, the CLI into exit code 2.
    """


class MemoryLimitExceeded(TfmemError, MemoryError):
    """The process passed its memory limit and the guard stopped the cell; the kernel and its variables live on."""

    detail = "the process passed its memory limit"

    def __str__(self) -> str:
        return self.args[0] if self.args else self.detail


class PreflightRefused(MemoryLimitExceeded):
    """The pre-flight predicted that the call's step would not fit the memory limit: it did not start (nothing of
    the call ran, so nothing was allocated); the message says the predicted peak, the room, and a batch that fits."""

    detail = "the pre-flight predicted the step would not fit the memory limit"


class MemoryGrowthWarning(UserWarning):
    """TensorFlow's peak grew run after run (epochs of a fit, repeated cells): something is kept between them."""
