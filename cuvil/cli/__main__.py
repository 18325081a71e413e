"""``python -m cuvil.cli ...``: the ``cuvil`` command."""

import sys

from cuvil.cli import main

sys.exit(main())
