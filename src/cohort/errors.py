"""Exception types shared by every part of cohort.

`ConfigError` is raised for anything a user can fix by changing a setting or a path; it subclasses
`ValueError` so callers that already catch ValueError keep working. The CLI turns a `CohortError` into a
one-line message and a non-zero exit instead of a traceback.
"""


class CohortError(Exception):
    """Base class of every error cohort raises on purpose."""


class ConfigError(CohortError, ValueError):
    """A setting, path or input that cannot work; the message names the field, the value and the fix."""


class DataError(ConfigError):
    """A dataset row that cannot be used (an unreadable image, a prompt without the placeholder a processor
    needs); the message names the source, the row and the fix. A ConfigError, so the CLI exits with 2."""
