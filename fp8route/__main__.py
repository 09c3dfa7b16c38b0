"""`python -m fp8route`: the same command as `fp8route`."""

import sys

from fp8route.cli import main

sys.exit(main())
