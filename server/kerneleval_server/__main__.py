"""`python -m kerneleval_server serve [flags]`."""

import sys

from kerneleval_server.main import main

if __name__ == "__main__":
    sys.exit(main())
