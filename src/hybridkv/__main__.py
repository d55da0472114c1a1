"""``python -m hybridkv``: the command line, as the ``hybridkv`` script runs it."""

import sys

from hybridkv.tools.cli import main

sys.exit(main())
