"""Suite-wide settings."""

import os

from hypothesis import settings

# Property tests explore the same examples on every run (CI must not flake on a lucky
# draw); a failure found once stays found. `HYPOTHESIS_PROFILE=explore` draws afresh.
settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))
