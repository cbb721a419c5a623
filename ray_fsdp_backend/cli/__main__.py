"""``python -m ray_fsdp_backend.cli`` is ``ray-fsdp``."""

import sys

from ray_fsdp_backend.cli.main import main

sys.exit(main())
