"""The vLLM worker extension: what runs inside each vLLM worker for the vLLM backend.

vLLM mixes :class:`WeightSyncExtension` into its worker class (``LLM(worker_extension_cls=
"backends.vllm_worker.WeightSyncExtension")``), so each tensor-parallel worker has these methods
and :class:`backends.vllm_backend.VLLMBackend` calls them with ``LLM.collective_rpc``. Every method
name starts with ``rlhf_`` so none shadows a method of vLLM's own worker. Arguments are plain
Python data and tensors, which every vLLM executor can carry.

Weight loading is vLLM's layerwise reload, held open across the buckets of one sync: the first
bucket calls ``initialize_layerwise_reload`` (every layer is put back in checkpoint layout),
each bucket goes through ``model.load_weights`` (which fuses q/k/v and gate/up, shards for tensor
parallelism, and processes a layer as soon as all of its tensors have arrived), and
``rlhf_finish_weight_update`` calls ``finalize_layerwise_reload``. A layer may therefore span
buckets. Calling ``model.load_weights`` on a loaded model without this fails: after loading,
vLLM replaces parameters (on CPU it packs every linear weight into a oneDNN / sgl kernel handle
and leaves an empty ``weight``), and the replacements carry no ``weight_loader``.

Log-probs: the engine runs with ``logprobs_mode="processed_logprobs"``, which gives the
log-softmax of the temperature-scaled logits, but *after* top-k / top-p truncation
(renormalised over the kept tokens). :meth:`WeightSyncExtension.rlhf_install_logprob_hook` makes
the sampler return the log-softmax taken just *before* truncation instead, which is this
project's convention; with no truncation the two are the same and the hook stays out of the way.

This module imports vLLM only inside methods, so importing it never starts vLLM.
"""

from __future__ import annotations

import datetime
import glob
import os
from typing import Any

import torch

from backends.shared_tensor import SharedBucket, open_shared_bucket

__all__ = ["WeightSyncExtension", "manifest_to_wire"]


def manifest_to_wire(manifest) -> dict[str, Any]:
    """A :class:`backends.base.BucketManifest` as plain data for ``collective_rpc``."""
    return {
        "names": [t.name for t in manifest.tensors],
        "shapes": [list(t.shape) for t in manifest.tensors],
        "offsets": [t.offset for t in manifest.tensors],
        "dtype": str(manifest.dtype).removeprefix("torch."),
        "numel": manifest.numel,
    }


def _unflatten(wire: dict[str, Any], flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    views = []
    for name, shape, offset in zip(wire["names"], wire["shapes"], wire["offsets"]):
        numel = 1
        for s in shape:
            numel *= s
        views.append((name, flat[offset : offset + numel].view(shape)))
    return views


class WeightSyncExtension:
    """Methods mixed into each vLLM worker (``self`` is the worker: ``self.model_runner``,
    ``self.rank``, ``self.device``, ``self.vllm_config``)."""

    # ---- log-probs -----------------------------------------------------------------------
    def rlhf_install_logprob_hook(self, banned: list[int] | None = None) -> str:
        """Make the sampler report log-probs taken before top-k / top-p truncation.

        ``banned``: token ids never sampled (a vision-language model's image placeholders), a truncation like
        top-k: masked after the log-probs are read, so the reported log-probs stay the untruncated ones the
        trainer computes; greedy decoding takes the argmax over the others.
        Returns which sampler was hooked ("v1" or "v2"). Raises RuntimeError when this vLLM's
        sampler has neither known shape (then the convention cannot be guaranteed).
        """
        sampler = self.model_runner.sampler
        if getattr(sampler, "_rlhf_hooked", False):
            return sampler._rlhf_hooked
        ban = torch.tensor(sorted(set(banned or ())), dtype=torch.long)

        def mask(logits):
            if len(ban):
                logits[:, ban.to(logits.device)] = float("-inf")
            return logits

        if hasattr(sampler, "topk_topp_sampler"):  # the V1 model runner (CPU, and GPU when chosen)
            truncating = sampler.topk_topp_sampler
            inner = truncating.forward

            def forward(logits, generators, k, p):
                if k is None and p is None and not len(ban):
                    return inner(logits, generators, k, p)
                # ``logits`` are temperature-scaled here; ``inner`` truncates them in place.
                scaled_logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
                sampled, _ = inner(mask(logits), generators, k, p)
                return sampled, scaled_logprobs

            truncating.forward = forward
            if len(ban):  # greedy rows: the argmax of the unscaled logits, read before this call
                greedy = sampler.greedy_sample
                sampler.greedy_sample = lambda logits: greedy(mask(logits.clone()))
            sampler._rlhf_hooked = "v1"
        elif hasattr(sampler, "_sample_random"):  # the V2 model runner (GPU default)
            if len(ban):
                raise RuntimeError("vLLM's V2 model runner: banning the image placeholders is built for the V1 "
                                   "runner only; start vLLM with VLLM_USE_V2_MODEL_RUNNER=0 for a "
                                   "vision-language model")
            inner = sampler._sample_random

            def _sample_random(processed_logits, expanded_idx_mapping, idx_mapping_np, pos, top_k, top_p, *rest):
                if top_k is None and top_p is None:
                    return inner(processed_logits, expanded_idx_mapping, idx_mapping_np, pos, top_k, top_p, *rest)
                scaled_logits = processed_logits.clone()  # truncation below may write in place
                sampled, _ = inner(processed_logits, expanded_idx_mapping, idx_mapping_np, pos, top_k, top_p, *rest)
                return sampled, scaled_logits

            sampler._sample_random = _sample_random
            sampler._rlhf_hooked = "v2"
        else:
            raise RuntimeError(
                f"vLLM sampler {type(sampler).__name__} has neither 'topk_topp_sampler' nor '_sample_random'; "
                "this vLLM version is not supported by the vLLM backend (tested: vLLM 0.32)"
            )
        return sampler._rlhf_hooked

    # ---- weight-update group -------------------------------------------------------------
    def rlhf_init_weight_update_group(self, spec: dict[str, Any]) -> int:
        """Join the trainer's side group as rank ``rank_offset + this worker's rank``; returns it."""
        from backends.base import WeightGroupSpec
        from backends.embedded import open_weight_update_group

        spec = WeightGroupSpec(**spec)
        rank = spec.rank_offset + self.rank
        if spec.backend == "nccl":
            torch.cuda.set_device(self.device)
        self._rlhf_group = open_weight_update_group(spec, rank)
        self._rlhf_group_spec = spec
        return rank

    def rlhf_destroy_weight_update_group(self) -> None:
        """Leave the side group: ``abort()`` after a failed receive (a graceful ``shutdown()`` may wait on the
        broadcast that will never finish), ``shutdown()`` otherwise."""
        group = getattr(self, "_rlhf_group", None)
        if group is not None:
            if getattr(self, "_rlhf_group_failed", False):
                group.abort()
            else:
                group.shutdown()
        self._rlhf_group = None
        self._rlhf_group_spec = None
        self._rlhf_group_failed = False

    def rlhf_receive_bucket(self, wire: dict[str, Any], src_rank: int) -> None:
        """Receive one flat bucket broadcast from group rank ``src_rank`` and load it."""
        import torch.distributed as dist

        group, spec = getattr(self, "_rlhf_group", None), getattr(self, "_rlhf_group_spec", None)
        if group is None:
            raise RuntimeError("no weight-update group on this worker; call init_weight_update_group first")
        device = self.device if spec.backend == "nccl" else torch.device("cpu")
        flat = torch.empty(wire["numel"], dtype=getattr(torch, wire["dtype"]), device=device)
        opts = dist.BroadcastOptions()
        opts.rootRank = src_rank
        opts.rootTensor = 0
        opts.timeout = datetime.timedelta(seconds=spec.timeout_s)
        try:
            # No timeout on wait: on NCCL an expired timed wait aborts the communicator. The
            # broadcast's own timeout (gloo) or the group's (NCCL watchdog) bounds it.
            group.broadcast([flat], opts).wait()
        except Exception as exc:
            self._rlhf_group_failed = True  # its destroy aborts
            raise RuntimeError(
                f"worker rank {self.rank}: receiving a bucket of {len(wire['names'])} tensors "
                f"({flat.numel() * flat.element_size()} bytes) from rank {src_rank} of weight-update group "
                f"{spec.group_name!r} failed or timed out after timeout_s={spec.timeout_s}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        self._rlhf_load(_unflatten(wire, flat))

    # ---- other transports ----------------------------------------------------------------
    def rlhf_load_tensor_bucket(
        self, wire: dict[str, Any], flat: torch.Tensor | None = None, shared: SharedBucket | None = None
    ) -> None:
        """Load a bucket handed over as a tensor (in process), or as a
        :class:`backends.shared_tensor.SharedBucket` (this worker opens the payload of its rank).

        A shared bucket is opened here, by this worker, on its own device: the sender's device
        identity must be this worker's (GPU UUID; host on CPU), else it is refused naming both. It
        is copied into memory of this worker, and the copy is complete before this returns: the
        sender reuses its buffer as soon as the call returns, and a layer that spans buckets keeps
        views of its tensors until its last tensor arrives.
        """
        if shared is not None:
            source = open_shared_bucket(shared, self.device, receiver=self.rank)
            owned = torch.empty(source.shape, dtype=source.dtype, device=self.device)
            owned.copy_(source)
            if owned.is_cuda:  # the copy is queued on this worker's current stream: wait for it
                torch.cuda.current_stream(owned.device).synchronize()
            del source  # release the mapping (and, on CUDA, torch's reference on the sender's block)
        else:
            owned = torch.empty(flat.shape, dtype=flat.dtype, device=self.device)
            owned.copy_(flat)
        self._rlhf_load(_unflatten(wire, owned))

    def rlhf_reload_from_disk(self, path: str) -> None:
        """Load every ``*.safetensors`` file in directory ``path`` (HF names) as one sync."""
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        for file in files:
            with safe_open(file, framework="pt") as f:
                self._rlhf_load([(key, f.get_tensor(key)) for key in f.keys()])

    def rlhf_finish_weight_update(self) -> list[str] | None:
        """Close the layerwise reload the first bucket opened.

        Returns None when none was open, else the HF names a touched layer still lacked (empty when
        the sync was complete): vLLM processes such a layer anyway, with those parts undefined.
        """
        if not getattr(self, "_rlhf_reload_open", False):
            return None
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        model = self.model_runner.get_model()
        packed = self._rlhf_packed_modules()
        missing = []
        for (module_path, param_name), shards in sorted(self._rlhf_loaded.items(), key=lambda kv: kv[0]):
            if None in shards:
                continue
            prefix, _, packed_name = module_path.rpartition(".")
            parts = packed[packed_name]
            missing += [f"{prefix}.{parts[i]}.{param_name}" for i in range(len(parts)) if i not in shards]
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(model, self.vllm_config.model_config)
        self._rlhf_reload_open = False
        self._rlhf_loaded = {}
        if torch.device(self.device).type == "cuda":
            # the sync's receive / copy buffers went back to torch's cache; hand them to the driver, so a
            # colocated KV cache waking after this sync can map them
            torch.cuda.empty_cache()
        return missing

    def _rlhf_load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Check every name and shape of one bucket, then load it into the open layerwise reload."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        model = self.model_runner.get_model()
        targets = []
        for name, tensor in named:
            if self._rlhf_is_expert_weight(name):
                continue  # vLLM's expert loader places it; its name and shape were checked against the checkpoint
            resolved = self._rlhf_resolve(name)
            part = self._rlhf_local_part(name, read=False)
            if resolved is None or part is None:
                raise KeyError(f"tensor {name!r} is not a weight of this {type(model).__name__}; nothing was loaded")
            if list(tensor.shape) != part[0]:
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, the engine's weight is {tuple(part[0])}; "
                    "nothing was loaded"
                )
            targets.append(resolved[1:])
        with set_current_vllm_config(self.vllm_config):
            if not getattr(self, "_rlhf_reload_open", False):
                initialize_layerwise_reload(model)
                self._rlhf_reload_open = True
                self._rlhf_loaded = {}
            model.load_weights(named)
        for module_path, param_name, shard in targets:
            self._rlhf_loaded.setdefault((module_path, param_name), set()).add(shard)

    # ---- reading weights back -----------------------------------------------------------
    def rlhf_get_weight(self, name: str) -> dict[str, Any] | None:
        """This worker's part of HF tensor ``name`` as the engine computes with it.

        Returns None when ``name`` is no weight, else ``{"tensor": CPU tensor, "shard_dim": int or
        None, "shard_index": int}``: the caller concatenates the parts of distinct ``shard_index``
        along ``shard_dim`` (None: every worker holds the whole tensor).
        """
        part = self._rlhf_local_part(name, read=True)
        if part is None:
            return None
        _, tensor, shard_dim, shard_index = part
        return {"tensor": tensor, "shard_dim": shard_dim, "shard_index": shard_index}

    def _rlhf_is_expert_weight(self, name: str) -> bool:
        """Whether ``name`` is an expert tensor of the checkpoint (one expert's ``...mlp.experts.3.gate_proj.weight``,
        or a fused one like GPT-OSS's ``...mlp.experts.gate_up_proj``) of a layer whose experts vLLM keeps in fused
        parameters of its own: its ``load_weights`` maps such names through the model's expert mapping (which
        expert, which half of the fused gate/up), which this worker does not repeat."""
        prefix, sep, rest = name.partition(".experts.")
        if not sep:
            return False
        try:
            experts = self.model_runner.get_model().get_submodule(prefix + ".experts")
        except AttributeError:
            return False
        return not hasattr(experts, rest.split(".", 1)[0])  # not a ModuleList of per-expert modules

    def _rlhf_packed_modules(self) -> dict[str, list[str]]:
        """Fused module name -> the checkpoint's parts, of the model and its inner models (a Qwen-VL's language
        model declares its own)."""
        if getattr(self, "_rlhf_packed", None) is None:
            self._rlhf_packed = {}
            for module in self.model_runner.get_model().modules():
                self._rlhf_packed.update(getattr(module, "packed_modules_mapping", None) or {})
        return self._rlhf_packed

    def _rlhf_resolve(self, name: str):
        """(module, its path, parameter name, packed shard index or None) holding HF tensor ``name``,
        or None when the model has no such weight."""
        model = self.model_runner.get_model()
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        if mapper is not None:  # the checkpoint's names renamed as the model's load_weights renames them
            name = mapper.get_rename_mapper().map_name(name)  # (Qwen-VL: model.visual. -> visual., ...)
            if name is None:
                return None
        module_path, _, param_name = name.rpartition(".")
        shard = None
        for packed, parts in self._rlhf_packed_modules().items():
            for i, part in enumerate(parts):
                suffix = "." + part
                if module_path.endswith(suffix) and part != packed:
                    module_path, shard = module_path[: -len(suffix)] + "." + packed, i
                    break
            if shard is not None:
                break
        try:
            module = model.get_submodule(module_path)
        except AttributeError:
            return None
        base = getattr(module, "base_layer", module)  # a LoRA wrapper keeps the layer here
        if not hasattr(base, param_name):
            return None
        return base, module_path, param_name, shard

    def _rlhf_local_part(self, name: str, read: bool):
        """(full HF shape, local tensor or None, shard dim, shard index) of ``name``, or None."""
        from vllm.model_executor.layers.linear import (
            ColumnParallelLinear,
            LinearBase,
            QKVParallelLinear,
            RowParallelLinear,
        )
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        resolved = self._rlhf_resolve(name)
        if resolved is None:
            return None
        module, _, param_name, shard = resolved
        tp_size = getattr(module, "tp_size", 1)
        tp_rank = getattr(module, "tp_rank", 0)
        shard_index = tp_rank
        if isinstance(module, VocabParallelEmbedding):
            idx = module.shard_indices
            rows = idx.org_vocab_end_index - idx.org_vocab_start_index
            full = [module.org_vocab_size, module.embedding_dim]
            tensor = getattr(module, param_name)[:rows] if read else None
            return full, _to_cpu(tensor), 0 if tp_size > 1 else None, shard_index
        if isinstance(module, LinearBase):
            is_weight = param_name == "weight"
            if read:
                tensor = _effective_linear_weight(module) if is_weight else getattr(module, param_name)
            rows_here = getattr(module, "output_size_per_partition", module.output_size)
            local_rows = [rows_here]
            if isinstance(module, QKVParallelLinear):
                q = module.num_heads * module.head_size
                kv = module.num_kv_heads * module.head_size
                v = module.num_kv_heads * module.v_head_size
                local_rows = [q, kv, v]
                if shard is not None and shard > 0:
                    shard_index = tp_rank // module.num_kv_head_replicas
            elif shard is not None:  # merged column-parallel: gate / up
                local_rows = [size // tp_size for size in module.output_sizes]
            start = sum(local_rows[:shard]) if shard is not None else 0
            length = local_rows[shard] if shard is not None else rows_here
            if isinstance(module, RowParallelLinear):
                shard_dim = 1 if (is_weight and tp_size > 1) else None
                full = [module.output_size, module.input_size] if is_weight else [module.output_size]
            else:
                shard_dim = 0 if (isinstance(module, ColumnParallelLinear) and tp_size > 1) else None
                replicas = module.num_kv_head_replicas if isinstance(module, QKVParallelLinear) and shard else 1
                full_rows = length * tp_size // replicas if shard_dim is not None else length
                full = [full_rows, module.input_size] if is_weight else [full_rows]
            if read and shard_dim != 1:
                tensor = tensor[start : start + length]
            return full, _to_cpu(tensor) if read else None, shard_dim, shard_index
        param = getattr(module, param_name)
        return list(param.shape), _to_cpu(param) if read else None, None, 0


def _effective_linear_weight(layer) -> torch.Tensor:
    """[out, in] weight of a linear layer as its kernel uses it.

    On CPU vLLM packs the weight into a kernel handle and leaves ``layer.weight`` empty; the
    layer's own GEMM applied to an identity matrix then gives the weight back exactly
    (each output element is one weight times 1.0).
    """
    weight = layer.weight
    if weight.numel() > 0 or not hasattr(layer, "cpu_linear"):
        return weight
    eye = torch.eye(layer.input_size_per_partition, dtype=layer.params_dtype, device=weight.device)
    with torch.inference_mode():
        return layer.cpu_linear(eye, weight, None).t()


def _to_cpu(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().to("cpu", copy=True).contiguous()
