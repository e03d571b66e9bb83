"""``python -m oss_plus``: see :mod:`oss_plus.cli`."""

import sys

from oss_plus.cli import main

sys.exit(main())
