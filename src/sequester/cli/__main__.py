"""``python -m sequester.cli``: the ``sequester`` command."""

import sys

from sequester.cli.entry import main

sys.exit(main())
