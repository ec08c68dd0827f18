"""rlhf_sg: an RLHF trainer with pluggable rollout engines and fast weight sync."""

__version__ = "0.1.0.dev0"
