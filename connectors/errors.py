"""onceflow's errors: one hierarchy, each kind with its exit code and what to do next.

An error raised in one of Spark's Python workers reaches the driver as the text of a
StreamingQueryException, so `from_text` turns that text back into the typed error: the CLI,
the runner and the metrics then match types, never class names in strings.
"""

from __future__ import annotations

import re

EXIT_FAILURE, EXIT_BAD_CONFIG = 1, 2


class OnceflowError(RuntimeError):
    """Base of every error onceflow raises on purpose; the message says what to do next."""

    exit_code = EXIT_FAILURE


class OptionError(OnceflowError, ValueError):
    """A data source option is missing or malformed; the message names the option."""


class DataLossError(OnceflowError):
    """Offsets the query still had to read are gone from Kafka (retention, a recreated topic)."""


class FencedError(OnceflowError):
    """Another instance with the same transactional id took over; this one must stop."""


class TransactionTimedOutError(OnceflowError):
    """The broker aborted the epoch's transaction because it outlived its timeout."""


class CheckpointMismatchError(OnceflowError):
    """The sink's markers do not describe this checkpoint: deleted, foreign, or restored older."""


class StagingError(OnceflowError):
    """A staged side-record file of the epoch is unreadable; the epoch must be recomputed."""


class CheckpointClaimError(OnceflowError):
    """Another instance holds the checkpoint's lease."""


class KafkaUnreachableError(OnceflowError):
    """Kafka did not answer within the retry budget; the message names the address and the
    client's last error (connection refused, name resolution, TLS, authentication)."""


class RegistryUnreachableError(OnceflowError):
    """The schema registry did not answer within the retry budget; the message names its URL."""


class RegistryRefusedError(OnceflowError):
    """The schema registry answered with a refusal (an incompatible schema, bad credentials);
    the message carries the registry's own words."""


KINDS: dict[str, type[OnceflowError]] = {
    kind.__name__: kind
    for kind in (
        OptionError,
        DataLossError,
        FencedError,
        TransactionTimedOutError,
        CheckpointMismatchError,
        StagingError,
        CheckpointClaimError,
        KafkaUnreachableError,
        RegistryUnreachableError,
        RegistryRefusedError,
    )
}
_IN_TEXT = re.compile(r"(?:onceflow\S*\.)?(" + "|".join(KINDS) + r"): (.*)")


def from_text(text: str) -> OnceflowError | None:
    """The onceflow error named in a Python worker's traceback text, or None."""
    match = _IN_TEXT.search(text)
    if match is None:
        return None
    return KINDS[match.group(1)](match.group(2).strip())


def describe(error: BaseException) -> str:
    """One line: the kind and the message (which says what to do next)."""
    return f"{type(error).__name__}: {error}"
