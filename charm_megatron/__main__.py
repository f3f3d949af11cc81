"""``python -m charm_megatron`` is the ``charm-megatron`` command."""

import sys

from charm_megatron.cli import main

sys.exit(main())
