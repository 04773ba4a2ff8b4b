"""The one exception type users see: a message that names the problem and the fix."""


class SparsegenError(Exception):
    """Bad input or a missing resource. The CLI prints it as one line, never as a traceback."""
