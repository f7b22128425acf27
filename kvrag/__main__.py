"""`python -m kvrag`: the same command line as `kvrag`."""

import sys

from kvrag.cli import main

sys.exit(main())
