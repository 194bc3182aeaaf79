"""Errors a user can act on.

Every CLI catches :class:`RedraftError` and prints its message without a traceback, so the
message must name the file, record or value at fault and say what to do.
"""


class RedraftError(Exception):
    """Base class of all errors redraft raises for bad input or environment."""


class TargetLoadError(RedraftError):
    """The target model (or its tokenizer) could not be loaded."""


class FingerprintMismatchError(RedraftError):
    """An artifact was built for a target whose tokenizer differs from the one given."""


class ArtifactError(RedraftError):
    """An artifact directory or file is missing, truncated, corrupted or of the wrong kind."""


class DataError(RedraftError):
    """A data source cannot be read (not JSON, unknown spec, missing file)."""


class ConfigError(RedraftError):
    """A recipe, command-line or API setting is unknown or invalid.

    ``param`` names the argument at fault (e.g. ``"temperature"``) when there is one, so a
    server can report it in its error object; the message names it too.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
