"""Weight sync: from the trainer's ZeRO-3 shards into the rollout engines, one flat bucket at a time.

Four rooms, read in this order:

* :mod:`rlhf_sg.sync.plan`: the buckets and their manifests (:func:`plan_buckets`), and the check
  every engine makes of a plan before any byte moves;
* :mod:`rlhf_sg.sync.gather`: full buckets out of ZeRO-3 shards, one collective exchange per bucket
  (:func:`gather_bucket`);
* :mod:`rlhf_sg.sync.transports`: how a bucket reaches the engines: a broadcast on a side group
  (``"collective"``), a colocated in-memory hand-off (``"tensor"``), or files (``"disk"``);
* :mod:`rlhf_sg.sync.syncer`: :class:`WeightSyncer`, which drives the three with one double-buffer
  loop, on every trainer rank.
"""

from rlhf_sg.sync.gather import GatherStaging, gather_bucket, gathered
from rlhf_sg.sync.plan import full_shape, hf_name, manifest_bytes, named_weights, plan_buckets
from rlhf_sg.sync.syncer import DEFAULT_BUCKET_BYTES, TRANSPORTS, WeightSyncer

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "TRANSPORTS",
    "GatherStaging",
    "WeightSyncer",
    "full_shape",
    "gather_bucket",
    "gathered",
    "hf_name",
    "manifest_bytes",
    "named_weights",
    "plan_buckets",
]
