"""``python -m unbroken.run ...``: the same as ``unbroken run ...``."""

import sys

from unbroken.run.cli import main

sys.exit(main(sys.argv[1:]))
