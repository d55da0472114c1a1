"""One exception type for everything a user can get wrong.

The CLI turns it into a single line on stderr and exit status 2; library users catch it
to tell bad input apart from bugs.
"""


class HybridKVError(ValueError):
    """Bad input or an impossible configuration; the message names the problem and the fix."""

