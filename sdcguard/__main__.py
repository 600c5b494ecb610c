"""``python -m sdcguard ...``: the same command line as ``sdcguard ...``."""

import sys

from sdcguard.cli import main

if __name__ == "__main__":
    sys.exit(main())
