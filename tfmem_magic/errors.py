"""One base exception for the package; usage errors carry the fix in their message."""


class TfmemError(Exception):
    """Base class of every error tfmem_magic raises on purpose."""


class TfmemUsageError(TfmemError, ValueError):
    """Bad arguments or options; the message says what to write instead.

    The IPython adapter turns it into IPython's UsageError, the CLI into exit code 2.
    """
