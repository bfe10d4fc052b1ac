"""Exception types shared by every part of cohort.

`ConfigError` is raised for anything a user can fix by changing a setting or a path; it subclasses
`ValueError` so callers that already catch ValueError keep working. The CLI turns a `CohortError` into a
one-line message and a non-zero exit instead of a traceback.

`CheckpointError` is defined here rather than in `cohort.checkpointing` (which re-exports it) so that the run
layer below it, which reads a checkpoint's trainer state back (`cohort.run.state`), can raise it too.
"""


class CohortError(Exception):
    """Base class of every error cohort raises on purpose."""


class ConfigError(CohortError, ValueError):
    """A setting, path or input that cannot work; the message names the field, the value and the fix."""


class DataError(ConfigError):
    """A dataset row that cannot be used (an unreadable image, a prompt without the placeholder a processor
    needs); the message names the source, the row and the fix. A ConfigError, so the CLI exits with 2."""


class RunDirInUseError(ConfigError):
    """The run directory is held by another live cohort run (its lock file); the message names the holder's
    pid and host and the fix. A ConfigError, so the CLI exits with 2."""


class CheckpointError(CohortError):
    """A checkpoint that cannot be read, fails its verification, or does not fit the model it is loaded into;
    the message names the file (or trainer-state field), what is wrong and the fix."""
