"""One exception type for everything a user can get wrong.

The CLI turns it into a single line on stderr and exit status 2; library users catch it
to tell bad input apart from bugs.
"""


class HybridKVError(ValueError):
    """Bad input or an impossible configuration; the message names the problem and the fix."""


def read_input_file(path, what: str) -> bytes:
    """The bytes of a file the user named (a config, a layout), or a one-line error."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise HybridKVError(f"cannot read {what} {path}: {e.strerror}; check the path") from None
