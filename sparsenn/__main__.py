"""``python -m sparsenn``: the ``sparsenn`` command (see :mod:`sparsenn.cli`)."""

import sys

from sparsenn.cli import main

if __name__ == "__main__":
    sys.exit(main())
