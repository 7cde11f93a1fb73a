"""``python -m stopline.cli``."""

import sys

from stopline.cli import main

sys.exit(main())
