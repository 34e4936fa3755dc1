"""The root of the errors pytrain reports to users.

An error in what the user gave pytrain (a config, a data or model file, an adapter, a device, a
checkpoint) derives from ``PytrainError``: the command line prints its message as one line and
exits with status 1.  Any other exception is a bug in pytrain and keeps its traceback.
"""


class PytrainError(Exception):
    """A problem with the user's input or environment; the message says what and where."""
