"""`python -m gemma_ane.cli`: the `gemma-ane` command."""

import sys

from . import main

if __name__ == "__main__":  # importing this module (a walk over the package does) runs nothing
    sys.exit(main())
