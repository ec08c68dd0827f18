"""What a rank sees of its machine: its GPU, its ``LOCAL_RANK``, the address its group meets at.

Every such decision is made here, from the rank's own environment, and nowhere else:

* Ray gives an actor with ``num_gpus=k`` its own ``CUDA_VISIBLE_DEVICES`` (the ids it was assigned, as
  the node listed them: integers, ``GPU-<uuid>`` or ``MIG-<uuid>``), so inside a one-GPU actor the
  only valid CUDA index is 0, whatever the rank's number in its group.
* DeepSpeed reads ``LOCAL_RANK`` as that CUDA index (``comm/torch.py`` ``init_distributed``,
  ``runtime/zero/partition_parameters.py`` ``Init``, ``runtime/engine.py`` ``_set_distributed_vars``),
  so it must be the local device index, never the global rank.
* A group meets at rank 0's node address and a port free there, never at loopback: ranks on other
  nodes would dial their own.

The functions take the environment as a mapping so the rules can be tested without Ray or a GPU;
:func:`this_rank` reads the real one.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "RankPlacement",
    "export_gloo_interface",
    "free_port",
    "interface_of",
    "local_device_index",
    "node_address",
    "rendezvous_for_bundle",
    "this_rank",
    "visible_devices",
]


def visible_devices(env: Mapping[str, str]) -> list[str] | None:
    """The ids in ``CUDA_VISIBLE_DEVICES`` as strings (ints, ``GPU-…`` or ``MIG-…`` alike), or None
    when the variable is unset (every device of the machine is visible)."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [d.strip() for d in value.split(",") if d.strip()]


def local_device_index(env: Mapping[str, str], assigned: Sequence[str | int] = ()) -> int:
    """The CUDA index (in this process's numbering) of the first GPU Ray ``assigned`` to this rank.

    CUDA numbers the devices of ``CUDA_VISIBLE_DEVICES`` 0, 1, …, so the index is the assigned id's
    position in that list: 0 inside a one-GPU Ray actor. With nothing assigned (not a Ray actor) or no
    ``CUDA_VISIBLE_DEVICES``, ``LOCAL_RANK`` from a launcher (torchrun) is kept, else 0.
    """
    visible = visible_devices(env)
    if assigned:
        first = str(assigned[0])
        if visible is None:
            # Ray sets CUDA_VISIBLE_DEVICES for GPU actors; without it the assigned id is the machine's own
            # numbering, which only an integer id can name
            if first.isdigit():
                return int(first)
            raise ValueError(f"placement: GPU {first!r} assigned but CUDA_VISIBLE_DEVICES is unset; "
                             "start the rank through Ray with num_gpus, or set CUDA_VISIBLE_DEVICES")
        if first not in visible:
            raise ValueError(f"placement: assigned GPU {first!r} is not in CUDA_VISIBLE_DEVICES={visible}; "
                             "was CUDA_VISIBLE_DEVICES changed inside the actor (runtime_env env_vars)?")
        return visible.index(first)
    launcher = env.get("LOCAL_RANK")
    if launcher is not None and launcher.isdigit():
        local = int(launcher)
        if visible is not None and local >= len(visible):
            raise ValueError(f"placement: LOCAL_RANK={local} but CUDA_VISIBLE_DEVICES lists {len(visible)} "
                             f"device(s) ({visible}); one GPU per rank needs LOCAL_RANK < {len(visible)}")
        return local
    return 0


def node_address() -> str:
    """This process's node address as the rest of the Ray cluster reaches it (127.0.0.1 without Ray)."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that holds ``address`` (None when none does)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return None


def export_gloo_interface(address: str, env: dict[str, str] | None = None) -> str | None:
    """Make gloo listen where other nodes reach this process: ``GLOO_SOCKET_IFNAME`` = the interface of
    ``address`` (a user's own setting is kept). Without it gloo advertises the address the hostname resolves
    to, or loopback when that is not a local address, and peers on other nodes dial their own loopback."""
    env = os.environ if env is None else env
    if "GLOO_SOCKET_IFNAME" in env:
        return env["GLOO_SOCKET_IFNAME"]
    name = interface_of(address)
    if name is not None and not address.startswith("127."):
        env["GLOO_SOCKET_IFNAME"] = name
    return name


@dataclass(frozen=True)
class RankPlacement:
    """What one rank sees: ``gpu_ids`` as Ray assigned them (strings), its CUDA index, the
    ``LOCAL_RANK`` DeepSpeed must read (the same index), and its node address."""

    gpu_ids: tuple[str, ...]
    local_device: int
    local_rank: int
    node_address: str

    def export_local_rank(self, env: dict[str, str] | None = None) -> None:
        """Set ``LOCAL_RANK`` (assigned, not defaulted: a value inherited from the driver is wrong here)."""
        (os.environ if env is None else env)["LOCAL_RANK"] = str(self.local_rank)


def this_rank() -> RankPlacement:
    """This process's :class:`RankPlacement`, from its environment and Ray's assignment."""
    import ray

    assigned = [str(g) for g in ray.get_gpu_ids()] if ray.is_initialized() else []
    index = local_device_index(os.environ, assigned)
    return RankPlacement(tuple(assigned), index, index, node_address())


def _node_and_port() -> tuple[str, int]:
    host = node_address()
    return host, free_port(host)


def rendezvous_for_bundle(pg, bundle_index: int = 0, timeout_s: float = 60.0) -> tuple[str, int]:
    """The address a group whose rank 0 sits on bundle ``bundle_index`` of placement group ``pg`` meets at:
    that bundle's node address and a port picked free on that node (by a task run there)."""
    import ray
    from ray.util.placement_group import placement_group_table
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = placement_group_table(pg)["bundles_to_node_id"][bundle_index]
    probe = ray.remote(_node_and_port).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
    for _ in range(8):
        ref = probe.remote()
        ready, _ = ray.wait([ref], timeout=timeout_s)
        if not ready:
            ray.cancel(ref, force=True)
            raise TimeoutError(f"placement: no rendezvous address from node {node_id} (bundle {bundle_index}) "
                               f"within {timeout_s} s; is that Ray node alive?")
        host, port = ray.get(ref)
        # groups start side by side: a port handed to one whose rank 0 has not bound it yet is still "free"
        if (host, int(port)) not in _HANDED_OUT:
            break
    _HANDED_OUT.add((host, int(port)))
    return host, int(port)


#: rendezvous addresses this process has handed out (a port is free again only once its group has bound it)
_HANDED_OUT: set[tuple[str, int]] = set()
