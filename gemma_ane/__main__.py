"""`python -m gemma_ane`: the `gemma-ane` command."""

import sys

from .cli import main

if __name__ == "__main__":  # importing this module (a walk over the package does) runs nothing
    sys.exit(main())
