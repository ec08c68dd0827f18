"""Every SGLang method, keyword, HTTP endpoint and field the SGLang backend uses exists in the pinned sglang.

The installed sglang source is read with ``ast`` (nothing of it is imported), and so is
``backends/sglang_backend.py``: the calls are collected from the backend's own code, so a call added
there is checked here without editing this file. This holds the GPU-only paths that CPU CI cannot
run (CUDA-IPC tensor hand-off, memory release with the memory saver, the http mode against real
servers) to the real API at least.
"""

from __future__ import annotations

import ast
import importlib.util
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BACKEND_SRC = REPO / "backends" / "sglang_backend.py"
SHIM_SRC = REPO / "backends" / "sglang_cpu" / "shims" / "sgl_kernel" / "__init__.py"

_spec = importlib.util.find_spec("sglang")
if _spec is None or not _spec.submodule_search_locations:
    pytest.skip("sglang is not installed (run recipes/install/sglang_cpu.sh)", allow_module_level=True)
SGLANG = Path(next(iter(_spec.submodule_search_locations)))
SRT = SGLANG / "srt"


@cache
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def find_class(path: Path, name: str) -> ast.ClassDef:
    for node in parse(path).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"class {name} not found in {path}")


def methods(path: Path, class_name: str) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """Methods of a class, including those of base classes defined in the same package file or mixins."""
    cls = find_class(path, class_name)
    found = {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for base in cls.bases:
        base_name = base.id if isinstance(base, ast.Name) else None
        for candidate in path.parent.glob("*.py"):
            if base_name and any(isinstance(n, ast.ClassDef) and n.name == base_name for n in parse(candidate).body):
                found = {**methods(candidate, base_name), **found}
    return found


def parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    args = fn.args
    return {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs} - {"self"}


def struct_fields(class_name: str) -> set[str]:
    """Fields of an ``io_struct`` request class (msgspec structs), including ``BaseReq``'s."""
    io_struct = SRT / "managers" / "io_struct.py"
    fields: set[str] = set()
    cls = find_class(io_struct, class_name)
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            fields.add(node.target.id)
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in ("BaseReq", "BaseBatchReq"):
            fields |= struct_fields(base.id)
    return fields


@cache
def http_routes() -> dict[str, str | None]:
    """HTTP route -> request struct its handler takes as body (None when it takes none)."""
    routes: dict[str, str | None] = {}
    for node in ast.walk(parse(SRT / "entrypoints" / "http_server.py")):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body_struct = None
        for arg in node.args.args:
            annotation = ast.unparse(arg.annotation) if arg.annotation else ""
            for word in annotation.replace("[", " ").replace(",", " ").replace("]", " ").split():
                if word.endswith(("ReqInput", "Req")):
                    body_struct = word
        for deco in node.decorator_list:
            if isinstance(deco, ast.Call) and deco.args and isinstance(deco.args[0], ast.Constant):
                target = ast.unparse(deco.func)
                if target.startswith("app.") and isinstance(deco.args[0].value, str):
                    routes[deco.args[0].value] = body_struct
    return routes


@cache
def server_args_fields() -> set[str]:
    """``ServerArgs`` fields: declared with annotations in ``arg_groups/fields/*.py``."""
    fields: set[str] = set()
    for path in (SRT / "arg_groups" / "fields").glob("*.py"):
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                fields.add(node.target.id)
    return fields


def rpc_keys(method: str) -> set[str]:
    """Keys the scheduler's handler of an RPC-forwarded Engine method reads from its ``params`` dict."""
    path = SRT / "managers" / "scheduler_components" / "weight_updater.py"
    fn = next(n for n in ast.walk(parse(path)) if isinstance(n, ast.FunctionDef) and n.name == method)
    return {
        n.slice.value
        for n in ast.walk(fn)
        if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and ast.unparse(n.value) == "params"
    }


def engine_methods() -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return methods(SRT / "entrypoints" / "engine.py", "Engine")


def keywords(call: ast.Call) -> set[str]:
    return {k.arg for k in call.keywords if k.arg is not None}


def backend_calls() -> list[ast.Call]:
    return [n for n in ast.walk(parse(BACKEND_SRC)) if isinstance(n, ast.Call)]


def first_string(call: ast.Call) -> str | None:
    if call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
        return call.args[0].value
    return None


def dict_keys(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Dict):
        return {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return set()


# ---- the backend's control calls: Engine.<method>(**kw) in engine mode, POST /<method> {kw} in http mode
def control_calls() -> list[tuple[str, set[str], bool]]:
    """Every ``.call("method", ...)``: method, keywords (ours removed), and whether it is engine-mode only."""
    found = []
    engine_driver = find_class(BACKEND_SRC, "_EngineDriver")
    engine_only = {id(n) for n in ast.walk(engine_driver)}
    for call in backend_calls():
        if isinstance(call.func, ast.Attribute) and call.func.attr == "call" and first_string(call):
            found.append((first_string(call), keywords(call) - {"timeout_s"}, id(call) in engine_only))
    return found


def test_backend_control_calls_are_found():
    names = {name for name, _, _ in control_calls()}
    assert {"init_weights_update_group", "update_weights_from_distributed", "begin_weight_update"} <= names


@pytest.mark.parametrize("method, kwargs, engine_only", control_calls(), ids=[n for n, _, _ in control_calls()])
def test_control_call_exists_on_engine_and_http_server(method, kwargs, engine_only):
    engine = engine_methods()
    assert method in engine, f"sglang.Engine has no method {method}"
    missing = kwargs - parameters(engine[method])
    assert not missing, f"Engine.{method} takes no keyword(s) {sorted(missing)}"
    if engine_only:
        return
    routes = http_routes()
    assert f"/{method}" in routes, f"the SGLang HTTP server has no endpoint /{method}"
    struct = routes[f"/{method}"]
    if kwargs:
        assert struct is not None, f"/{method} takes no request body"
        missing = kwargs - struct_fields(struct)
        assert not missing, f"/{method} body ({struct}) has no field(s) {sorted(missing)}"


def engine_attributes() -> set[str]:
    """Attributes ``Engine.__init__`` assigns (``self.loop``, ``self.tokenizer_manager``, ...)."""
    init = engine_methods()["__init__"]
    names = set()
    for node in ast.walk(init):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self":
                        names.add(t.attr)
    return names


def test_direct_engine_calls_exist():
    """``self.engine.<method>(...)`` calls in engine mode, with their keywords."""
    engine = engine_methods()
    checked = 0
    for call in backend_calls():
        func = call.func
        if isinstance(func, ast.Attribute) and ast.unparse(func.value) == "self.engine":
            assert func.attr in engine, f"sglang.Engine has no method {func.attr}"
            method = engine[func.attr]
            if method.args.kwarg is not None:  # forwards **kwargs over RPC; the scheduler side reads every key
                assert keywords(call) == rpc_keys(func.attr), (
                    f"Engine.{func.attr}: the scheduler reads {rpc_keys(func.attr)}"
                )
            else:
                missing = keywords(call) - parameters(method)
                assert not missing, f"Engine.{func.attr} takes no keyword(s) {sorted(missing)}"
            checked += 1
    # bare references such as run("flush_cache", self.engine.flush_cache), and attributes (self.engine.loop)
    known = set(engine) | engine_attributes()
    for node in ast.walk(parse(BACKEND_SRC)):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "self.engine":
            assert node.attr in known, f"sglang.Engine has no method or attribute {node.attr}"
    assert checked >= 2


def test_engine_attributes_the_pause_path_uses():
    """Engine mode pauses through the engine's tokenizer manager, as SGLang's own /pause_generation does."""
    assert {"loop", "tokenizer_manager"} <= engine_attributes()
    manager = methods(SRT / "managers" / "tokenizer_manager.py", "TokenizerManager")
    for call in backend_calls():
        func = call.func
        if isinstance(func, ast.Attribute) and ast.unparse(func.value) == "tm":
            assert func.attr in manager, f"TokenizerManager has no method {func.attr}"


def test_engine_shutdown_kills_through_the_module_name_the_backend_narrows():
    """``Engine.shutdown`` kills the host's descendants through the engine module's global ``kill_process_tree``
    (``kill_process_tree(os.getpid(), include_parent=False, ...)``), and that function's parameters are the ones
    the backend's narrowed stand-in takes: replacing the module global is what keeps a local Ray cluster alive."""
    engine_src = SRT / "entrypoints" / "engine.py"
    imported = {
        alias.asname or alias.name
        for node in parse(engine_src).body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert "kill_process_tree" in imported, "engine.py no longer imports kill_process_tree by name"
    calls = [
        n for n in ast.walk(engine_methods()["shutdown"])
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "kill_process_tree"
    ]
    assert calls, "Engine.shutdown no longer calls kill_process_tree"
    assert any(
        ast.unparse(c.args[0]) == "os.getpid()" and {"include_parent"} <= keywords(c) for c in calls
    ), [ast.unparse(c) for c in calls]
    utils = SRT / "utils" / "common.py"
    kill = next(n for n in ast.walk(parse(utils)) if isinstance(n, ast.FunctionDef) and n.name == "kill_process_tree")
    assert [a.arg for a in kill.args.args] == ["parent_pid", "include_parent", "skip_pid", "wait_timeout"]


def test_request_structs_the_backend_builds():
    """``PauseGenerationReqInput(mode=...)`` and friends: the classes, fields and allowed modes."""
    built = 0
    for call in backend_calls():
        name = call.func.id if isinstance(call.func, ast.Name) else None
        if name and name.endswith("ReqInput"):
            missing = keywords(call) - struct_fields(name)
            assert not missing, f"{name} has no field(s) {sorted(missing)}"
            built += 1
    assert built >= 2
    mode = next(
        n
        for n in find_class(SRT / "managers" / "io_struct.py", "PauseGenerationReqInput").body
        if isinstance(n, ast.AnnAssign) and ast.unparse(n.target) == "mode"
    )
    assert "'retract'" in ast.unparse(mode.annotation), "pause mode 'retract' is not accepted"


def test_http_endpoints_and_bodies():
    """Endpoints named in the http driver's URLs, and the keys of the bodies it posts to them."""
    routes = http_routes()
    posted: dict[str, set[str]] = {}
    for call in backend_calls():
        func = call.func
        if not isinstance(func, ast.Attribute):
            continue
        if func.attr == "_on_every_server" and first_string(call):
            body = call.args[2] if len(call.args) > 2 else None
            posted.setdefault(first_string(call), set()).update(dict_keys(body) if body is not None else set())
        if func.attr in ("request", "submit"):
            # request(base_url, "endpoint", "METHOD", body) or pool.submit(self.request, base_url, "endpoint", ...)
            body = next((a for a in call.args if isinstance(a, ast.Dict)), None)
            for arg in call.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value not in ("GET", "POST"):
                    keys = dict_keys(body) if body is not None else set()
                    posted.setdefault(arg.value.lstrip("/"), set()).update(keys)
                    break
    assert {"generate", "init_weights_update_group", "pause_generation", "get_server_info"} <= set(posted)
    generate_fields = set(parameters(engine_methods()["generate"])) | {"input_ids"}
    for endpoint, keys in posted.items():
        assert f"/{endpoint}" in routes, f"the SGLang HTTP server has no endpoint /{endpoint}"
        struct = routes[f"/{endpoint}"]
        if endpoint == "generate":  # GenerateReqInput is a dataclass; its fields mirror Engine.generate's
            missing = keys - generate_fields
        elif keys:
            assert struct is not None, f"/{endpoint} takes no request body"
            missing = keys - struct_fields(struct)
        else:
            missing = set()
        assert not missing, f"/{endpoint} takes no field(s) {sorted(missing)}"


def test_engine_kwargs_and_server_info_keys_are_server_args_fields():
    fields = server_args_fields()
    fn = next(
        n for n in ast.walk(parse(BACKEND_SRC)) if isinstance(n, ast.FunctionDef) and n.name == "sglang_engine_kwargs"
    )
    used = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Dict):
            used |= dict_keys(node)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update":
            used |= keywords(node)
    info_keys = set()
    for call in backend_calls():
        if isinstance(call.func, ast.Attribute) and call.func.attr == "get" and first_string(call):
            owner = ast.unparse(call.func.value)
            if owner in ("info", "saver"):
                info_keys.add(first_string(call))
    assert {"skip_tokenizer_init", "attention_backend", "max_total_tokens"} <= used
    assert {"context_length", "enable_deterministic_inference", "enable_memory_saver"} <= info_keys
    documented = {"enable_memory_saver", "enable_weights_cpu_backup", "mem_fraction_static", "max_running_requests"}
    missing = (used | info_keys | documented | {"tp_size"}) - fields
    assert not missing, f"not ServerArgs fields in this sglang: {sorted(missing)}"


def test_sampling_param_keys_exist():
    sglang_fields = {
        ast.unparse(n.target)
        for n in find_class(SRT / "sampling" / "sampling_params.py", "SamplingParams").body
        if isinstance(n, ast.AnnAssign)
    }
    fn = next(
        n for n in ast.walk(parse(BACKEND_SRC)) if isinstance(n, ast.FunctionDef) and n.name == "sglang_sampling_params"
    )
    keys = set().union(*(dict_keys(n) for n in ast.walk(fn)))
    keys |= {
        n.slice.value
        for n in ast.walk(fn)
        if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str)
    }
    assert {"max_new_tokens", "temperature", "stop_token_ids", "no_stop_trim", "sampling_seed"} <= keys
    missing = keys - sglang_fields
    assert not missing, f"SGLang's SamplingParams takes no {sorted(missing)}"


def _module_level_names(tree):
    """Names a module binds at its top level: classes, functions, assignments (``ModelRegistry = _ModelRegistry()``)."""
    names = set()
    for n in tree.body:
        if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(n.name)
        elif isinstance(n, ast.Assign):
            names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            names.add(n.target.id)
    return names


def test_imports_from_sglang_resolve():
    """``from sglang.X import Y`` in the backend: module X exists and defines (or re-exports) Y."""
    checked = 0
    for node in ast.walk(parse(BACKEND_SRC)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang"):
            parts = node.module.split(".")[1:]
            path = SGLANG.joinpath(*parts)
            path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
            assert path.exists(), f"no module {node.module}"
            tree = parse(path)
            defined = _module_level_names(tree)
            star_sources = [n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.names[0].name == "*"]
            for src in star_sources:
                src_path = SGLANG.joinpath(*src.split(".")[1:]).with_suffix(".py")
                defined |= _module_level_names(parse(src_path))
            for alias in node.names:
                assert alias.name in defined, f"{node.module} defines no {alias.name}"
                checked += 1
    assert checked >= 2


def test_flattened_bucket_layout_matches_what_the_backend_sends():
    """Receive side: one uint8 buffer of back-to-back tensors in manifest order; metadata fields by name."""
    bucket = SRT / "weight_sync" / "tensor_bucket.py"
    meta = {
        ast.unparse(n.target)
        for n in find_class(bucket, "FlattenedTensorMetadata").body
        if isinstance(n, ast.AnnAssign)
    }
    assert meta == {"name", "shape", "dtype", "start_idx", "end_idx", "numel"}
    # The trainer-side packer writes records with exactly these fields (SGLang's loader reads them by name).
    pack = next(
        n for n in ast.walk(parse(BACKEND_SRC)) if isinstance(n, ast.FunctionDef) and n.name == "pack_tensor_bucket"
    )
    records = [n for n in ast.walk(pack) if isinstance(n, ast.Call) and ast.unparse(n.func) == "SimpleNamespace"]
    assert records and all({k.arg for k in r.keywords} == meta for r in records)
    empty = methods(bucket, "FlattenedTensorBucket")["empty"]
    source = ast.unparse(empty)
    assert "torch.uint8" in source and "offset += size" in source
    updater = ast.unparse(parse(SRT / "model_executor" / "model_runner_components" / "weight_updater.py"))
    assert updater.count("'flattened_bucket'") >= 2, "flattened_bucket is not a load_format of both receive paths"


def test_trainer_side_group_mirrors_init_custom_process_group():
    """SGLang's workers join with a PrefixStore(group_name) and torch's process-group helper; so does ours."""
    fn = next(
        n
        for n in ast.walk(parse(SRT / "utils" / "common.py"))
        if isinstance(n, ast.FunctionDef) and n.name == "init_custom_process_group"
    )
    source = ast.unparse(fn)
    assert "PrefixStore(group_name, store)" in source
    assert "_new_process_group_helper(" in source and "group_name=group_name" in source
    ours = ast.unparse(
        next(
            n
            for n in ast.walk(parse(BACKEND_SRC))
            if isinstance(n, ast.FunctionDef) and n.name == "open_weight_update_group"
        )
    )
    assert "PrefixStore(spec.group_name, store)" in ours and "_new_process_group_helper(" in ours
    updater = ast.unparse(parse(SRT / "model_executor" / "model_runner_components" / "weight_updater.py"))
    assert "rank = rank_offset + self.tp_rank" in updater, "engine ranks are no longer rank_offset + tp_rank"


def test_logprob_and_cpu_switches_are_the_ones_sglang_reads():
    sampler = ast.unparse(parse(SRT / "layers" / "sampler.py"))
    assert "'SGLANG_RETURN_ORIGINAL_LOGPROB'" in sampler
    common = ast.unparse(parse(SRT / "utils" / "common.py"))
    assert "'SGLANG_USE_CPU_ENGINE'" in common
    assert "'SGLANG_CPU_OMP_THREADS_BIND'" in ast.unparse(parse(SRT / "utils" / "numa_utils.py"))


def test_stand_in_kernel_package_names_every_cpu_import():
    """Every ``from sgl_kernel import X`` SGLang runs at import time in CPU mode is defined by the stand-in.

    Those are module-level imports, directly or under a module-level ``if`` on a CPU flag.
    """
    provided = {
        t.id for n in parse(SHIM_SRC).body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)
    }
    provided |= {n.name for n in parse(SHIM_SRC).body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
    needed: dict[str, str] = {}
    for path in SGLANG.rglob("*.py"):
        if "test" in path.parts or "sgl_kernel" not in path.read_text():
            continue
        for node in parse(path).body:
            if not isinstance(node, ast.If) or "cpu" not in ast.unparse(node.test).lower():
                continue
            if "amx" in ast.unparse(node.test).lower() or "arm64" in ast.unparse(node.test).lower():
                continue  # paths taken only with real CPU kernels, which the stand-in disables
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom) and inner.module == "sgl_kernel":
                    for alias in inner.names:
                        needed.setdefault(alias.name, str(path.relative_to(SGLANG)))
    assert needed, "found no CPU-mode imports of sgl_kernel; the scan is broken"
    missing = {name: where for name, where in needed.items() if name not in provided}
    assert not missing, f"the stand-in sgl_kernel lacks {missing}"
