"""Routing policies across engines, in a SIMULATION: prefix-cache hits, trajectory latency and step time.

``python -m rlhf_sg.bench router [--engines 4] [--sessions 512] [--concurrency 128] [--seeds 3]``

No model runs here. Each policy of :mod:`rlhf_sg.serve.router` (the real :class:`Router`, called as the agent loop
and the endpoint call it: one session per trajectory, ``acquire`` per turn, ``release`` at its end) places the turns
of the same simulated workload on ``--engines`` simulated engines, each a continuous-batching server with a KV
memory of ``--kv-tokens`` tokens that holds the running requests and, in what is left, an LRU prefix cache of
finished turns' contexts. A turn's prompt is served from the cache up to the longest prefix of it that the engine
still holds (an earlier turn of its trajectory on that engine); the rest is prefilled. One engine iteration takes
``base + per_row x rows + prefill x new prompt tokens`` seconds; a request waits while the memory it needs (its
context plus its turn's cap) is not free after evicting cached prefixes.

The workload is long-tailed: ``--sessions`` trajectories, at most ``--concurrency`` in flight (a harness pool: a
finished trajectory starts the next), each with a prompt of 300-1500 tokens, a geometric number of turns (mean
``--mean-turns``, at most 16), turns of log-normal length (median ``--turn-tokens``, capped at 4x), a log-normal
tool time and observation between turns. Printed per policy: the prefix-cache hit fraction over turns 2.. (cached
prompt tokens / prompt tokens sent), the p50 / p90 trajectory latency, the step time (the last trajectory's end),
and the largest engine's share of the work; each ratio against sticky-least-loaded. The figures are the model's,
not an engine's: they rank policies under these assumptions and measure nothing about SGLang or vLLM.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import math
import random
import statistics
from dataclasses import dataclass, field

from rlhf_sg.serve.router import ROUTING_POLICIES, Router


@dataclass
class Turn:
    gen: int  # tokens this turn samples
    obs: int  # observation tokens after it (none after the last turn)
    tool_s: float


@dataclass
class Trajectory:
    key: str
    prompt: int
    turns: list[Turn]
    context: int = 0  # tokens so far (prompt + turns + observations)
    turn: int = 0
    start: float = 0.0
    end: float = 0.0


@dataclass
class Request:
    traj: Trajectory
    engine: int
    prompt: int  # the context the engine is sent
    left: int  # tokens still to sample
    reserve: int  # memory reserved: prompt + the turn's cap
    cached: int = 0


@dataclass
class Engine:
    kv_tokens: int
    running: list[Request] = field(default_factory=list)
    waiting: collections.deque = field(default_factory=collections.deque)
    cache: collections.OrderedDict = field(default_factory=collections.OrderedDict)  # session -> cached tokens, LRU
    reserved: int = 0
    busy: bool = False
    work_s: float = 0.0


def workload(args, seed: int) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for k in range(args.sessions):
        turns = min(16, 1 + int(math.log(1 - rng.random()) / math.log(1 - 1 / args.mean_turns)))
        ts = []
        for t in range(turns):
            gen = min(4 * args.turn_tokens, max(8, int(rng.lognormvariate(math.log(args.turn_tokens), 0.8))))
            obs = 0 if t == turns - 1 else min(1024, int(rng.lognormvariate(math.log(120), 0.7)))
            ts.append(Turn(gen, obs, rng.lognormvariate(math.log(0.5), 0.8)))
        out.append(Trajectory(f"traj{k}", rng.randint(300, 1500), ts))
    return out


def simulate(policy: str, trajectories: list[Trajectory], args) -> dict:
    router = Router(args.engines, policy)
    engines = [Engine(args.kv_tokens) for _ in range(args.engines)]
    events: list = []  # (time, order, kind, payload)
    order = 0
    cap = 4 * args.turn_tokens
    sent = cached = 0

    def push(t, kind, payload):
        nonlocal order
        order += 1
        heapq.heappush(events, (t, order, kind, payload))

    def submit(now, traj):
        prompt = traj.context
        engine = router.acquire(traj.key, prompt + cap)
        e = engines[engine]
        e.waiting.append(Request(traj, engine, prompt, traj.turns[traj.turn].gen, prompt + cap))
        if not e.busy:
            e.busy = True
            push(now, "step", engine)

    def admit(e: Engine) -> int:
        """Start waiting requests that fit (evicting cached prefixes, least recently used first); their new
        prompt tokens."""
        nonlocal sent, cached
        prefill = 0
        while e.waiting:
            r = e.waiting[0]
            hit = min(e.cache.get(r.traj.key, 0), r.prompt)
            own = e.cache.pop(r.traj.key, 0)  # the request's own prefix becomes part of its reservation
            while e.reserved + r.reserve + sum(e.cache.values()) > e.kv_tokens and e.cache:
                e.cache.popitem(last=False)
            if e.reserved + r.reserve > e.kv_tokens:
                if own:
                    e.cache[r.traj.key] = own
                break
            e.waiting.popleft()
            e.reserved += r.reserve
            r.cached = hit
            if r.traj.turn > 0:
                sent += r.prompt
                cached += hit
            prefill += r.prompt - hit
            e.running.append(r)
        return prefill

    live = collections.deque(trajectories)
    now = 0.0
    for _ in range(min(args.concurrency, len(live))):
        traj = live.popleft()
        traj.start, traj.context = now, traj.prompt
        submit(now, traj)
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "turn":
            submit(now, payload)
            continue
        e = engines[payload]
        prefill = admit(e)
        if not e.running:
            e.busy = False
            continue
        took = args.step_base_s + args.step_row_s * len(e.running) + args.prefill_token_s * prefill
        e.work_s += took
        done = []
        for r in e.running:
            r.left -= 1
            if r.left == 0:
                done.append(r)
        for r in done:
            e.running.remove(r)
            e.reserved -= r.reserve
            traj = r.traj
            turn = traj.turns[traj.turn]
            traj.context += turn.gen
            e.cache[traj.key] = traj.context  # the turn's whole context stays cached
            e.cache.move_to_end(traj.key)
            router.finish(traj.key, r.engine, r.reserve)
            traj.turn += 1
            if traj.turn < len(traj.turns):
                traj.context += turn.obs
                push(now + took + turn.tool_s, "turn", traj)
            else:
                traj.end = now + took
                router.release(traj.key)
                e.cache.pop(traj.key, None)  # nothing will extend it again
                if live:
                    nxt = live.popleft()
                    nxt.start, nxt.context = traj.end, nxt.prompt
                    push(traj.end, "turn", nxt)
        push(now + took, "step", payload)
    latency = sorted(t.end - t.start for t in trajectories)
    work = [e.work_s for e in engines]
    return {"hit": cached / max(1, sent), "p50": statistics.median(latency),
            "p90": latency[int(0.9 * (len(latency) - 1))], "step": max(t.end for t in trajectories),
            "imbalance": max(work) / (sum(work) / len(work))}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m rlhf_sg.bench router", description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--sessions", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=128, help="trajectories in flight at most")
    p.add_argument("--mean-turns", type=float, default=4.0)
    p.add_argument("--turn-tokens", type=int, default=200, help="median tokens sampled per turn")
    p.add_argument("--kv-tokens", type=int, default=100_000, help="KV memory of one simulated engine, in tokens")
    p.add_argument("--step-base-s", type=float, default=0.02)
    p.add_argument("--step-row-s", type=float, default=0.0004)
    p.add_argument("--prefill-token-s", type=float, default=5e-5)
    p.add_argument("--seeds", type=int, default=3, help="workloads, each run under every policy; medians printed")
    args = p.parse_args(argv)
    print(f"SIMULATION (no model, no engine): {args.engines} engines of {args.kv_tokens} KV tokens, {args.sessions} "
          f"trajectories ({args.concurrency} in flight), mean {args.mean_turns} turns of median {args.turn_tokens} "
          f"tokens; {args.seeds} workloads, medians")
    results = {policy: [simulate(policy, workload(args, seed), args) for seed in range(args.seeds)]
               for policy in ROUTING_POLICIES}
    med = {policy: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for policy, rs in results.items()}
    base = med["sticky_least_loaded"]
    print(f"{'policy':<22}{'prefix hit':>11}{'p50 s':>9}{'p90 s':>9}{'step s':>9}{'max/mean work':>15}"
          f"{'p90 vs sticky':>15}{'step vs sticky':>16}")
    for policy, m in med.items():
        print(f"{policy:<22}{m['hit']:>11.3f}{m['p50']:>9.1f}{m['p90']:>9.1f}{m['step']:>9.1f}{m['imbalance']:>15.2f}"
              f"{m['p90'] / base['p90']:>14.2f}x{m['step'] / base['step']:>15.2f}x")


if __name__ == "__main__":
    main()
