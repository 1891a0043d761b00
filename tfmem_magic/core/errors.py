"""One base exception for the package; usage errors carry the fix in their message."""

import re
from collections.abc import Iterator


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


def exception_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc` and every exception chained to it (its cause and context, theirs...), each once; none for None."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo += [current.__cause__, current.__context__]


def clip_message(message: str, limit: int) -> str:
    """The first line of an error message, at most `limit` characters: cut after the last sentence that fits, or at a
    word with an ellipsis where none ends past half of it. A message cut in the middle of a word or a parenthesis
    reads as broken (TensorFlow's errors can run for pages on one line)."""
    lines = message.strip().splitlines()
    line = lines[0] if lines else ""
    if len(line) <= limit:
        return line
    head = line[:limit]
    ends = [m.end() for m in re.finditer(r"(?<!e\.g)(?<!i\.e)[.!?]\)?(?=\s)", head)]
    if ends and ends[-1] >= limit // 2:
        return head[: ends[-1]]
    cut = head.rfind(" ")
    return head[: cut if cut > 0 else limit].rstrip(",;:(") + "…"
