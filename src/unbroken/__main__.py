import sys

from unbroken.cli.main import main

sys.exit(main())
