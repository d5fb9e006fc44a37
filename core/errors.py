"""Errors a user can cause. `hdr.cli.main` turns them into one line on stderr and an exit code
(2 unless the error says otherwise, e.g. 130 for a run stopped by Ctrl-C)."""


class UserError(Exception):
    """Bad input from the user (config, path, argument): reported without a traceback."""

    exit_code = 2


class RunInterrupted(UserError):
    """A run stopped by SIGINT or SIGTERM after leaving a state it can continue from; the
    message says how to continue. Exit code 128 + the signal number, as shells report it."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum

    def __reduce__(self):  # picklable across worker processes
        return (type(self), (str(self), self.signum))


def error_reason(err: BaseException) -> str:
    """The line of a library's error message that says why: its last non-empty line (FAISS's
    C++ errors start with where they were raised); the error's type when it says nothing."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def warn(message: str) -> None:
    """One `hdr: warning:` line on stderr: something is probably wrong, but the work goes on."""
    import sys

    sys.stderr.write(f"hdr: warning: {' '.join(message.split())}\n")
    sys.stderr.flush()
