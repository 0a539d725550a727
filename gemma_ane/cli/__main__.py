"""`python -m gemma_ane.cli`: the `gemma-ane` command."""

import sys

from . import main

sys.exit(main())
