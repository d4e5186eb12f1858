"""One error hierarchy for all of kvq.

Library code raises these; the CLI maps each class to an exit code and prints
the message without a traceback (unless KVQ_DEBUG=1). A message says what is
wrong *and* what to do next. This lives in `runtime` because every other
package may import `runtime` and `runtime` may import nothing of ours.
"""


class KvqError(Exception):
    """Base of every error kvq raises on purpose."""

    exit_code = 1


class RecipeError(KvqError):
    """A recipe (or a --set override) is invalid or cannot be found."""

    exit_code = 2


class InputError(KvqError):
    """A user-supplied file, directory or value is missing, corrupt or unusable."""

    exit_code = 3


class UnsupportedError(KvqError):
    """A valid request that this backend, model or machine cannot run."""

    exit_code = 4


class NumericsError(KvqError):
    """NaN/Inf activations, empty statistics, or similar numerical failures."""

    exit_code = 5


class StageError(KvqError):
    """A pipeline stage failed or an earlier stage's output is missing/mismatched."""

    exit_code = 6


class AccuracyBudgetError(KvqError):
    """An engine broke its recipe's accuracy budget."""

    exit_code = 7


class ExternalToolMissing(KvqError):
    """An external tool (trtllm-build, tritonserver) is not installed here.

    Raised after everything that can be done without it is done; the message
    carries the exact command to run on a machine that has it.
    """

    exit_code = 8


class ServerError(KvqError):
    """Triton server failed to start, become ready, or answer."""

    exit_code = 9


class RequestError(KvqError):
    """A generation request has an out-of-range or malformed field."""

    exit_code = 10
