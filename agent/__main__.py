"""``python -m agent …`` is ``eaglewatch-agent …``."""

import sys

from agent.cli import main

sys.exit(main())
