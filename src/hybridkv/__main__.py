import sys

from hybridkv.tools.cli import main

sys.exit(main())
