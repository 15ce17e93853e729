"""``python -m aruntime``."""

import sys

from aruntime.cli import main

sys.exit(main())
