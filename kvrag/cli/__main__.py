"""`python -m kvrag.cli`: the same command line as `kvrag`."""

import sys

from kvrag.cli.main import main

sys.exit(main())
