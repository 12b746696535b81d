"""``python -m agent_rl.cli``: the ``agent-rl`` command (as under ``torchrun -m``)."""

import sys

from agent_rl.cli import main

sys.exit(main())
