"""`python -m kerneleval.cli`: the `kerneleval` command."""

import sys

from kerneleval.cli import main

sys.exit(main())
