"""The command line's own mistakes, told apart from invalid plans by their exit code."""


class UsageError(Exception):
    """A command-line mistake (exit 2), as opposed to an invalid plan (exit 1)."""
