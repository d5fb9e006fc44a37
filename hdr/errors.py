"""Errors a user can cause. The CLI turns them into one line on stderr and exit code 2."""


class UserError(Exception):
    """Bad input from the user (config, path, argument): reported without a traceback."""
