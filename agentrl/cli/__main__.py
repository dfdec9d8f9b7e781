"""`python -m agentrl.cli ...`: the same as the `agentrl` command."""

import sys

from agentrl.cli import main

sys.exit(main())
