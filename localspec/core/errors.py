"""Errors that reach the user as one line and a non-zero exit code."""


class LocalspecError(Exception):
    """A failure the user can act on; the CLI prints it as one line."""

    exit_code = 1


class UsageError(LocalspecError):
    """Bad usage or input: missing model, incompatible pair, prompt too long (exit 2)."""

    exit_code = 2


class ModelNotFound(UsageError):
    """A model name, path or repo that cannot be resolved to a local file."""


class IncompatibleModels(UsageError):
    """A draft model whose vocabulary does not match the target's."""


class ContextFull(UsageError):
    """The prompt (or file) does not fit the context window."""


class GrammarError(UsageError):
    """A grammar or JSON schema that cannot be used, or a grammar that allows no token
    of the vocabulary at some point (exit 2; HTTP 400 in the server)."""


class PullError(LocalspecError):
    """Fetching model weights failed; nothing half-written is left behind."""


class PullInterrupted(PullError):
    """Ctrl-C during a pull: stop, do not try the next source."""


class BackendError(LocalspecError):
    """llama.cpp refused to load a model or decode a batch."""
