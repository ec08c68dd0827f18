"""A user's backend subclass (``module:Class``) that sleeps in generate, for the timing test."""

import os
import time

from backends.embedded import EmbeddedBackend


class SlowBackend(EmbeddedBackend):
    name = "slow"

    def generate(self, prompts, params):
        time.sleep(float(os.environ.get("SLOW_BACKEND_DELAY_S", "2.0")))
        return super().generate(prompts, params)
