"""Hugging Face Qwen3 checkpoints: config.json validation and safetensors -> sharded parameters.

    config = load_hf_config(path)       # transformers Qwen3Config, checked
    model = Qwen3ForCausalLM(config)
    load_model(model, path)             # every parameter filled, or a CheckpointError saying why

Memory: tensors are read one at a time from each safetensors file (memory-mapped) and copied into
this rank's slice by the parameter's own ``weight_loader``, so at most one full tensor is in flight
beyond the model itself.

FP8 checkpoints (Qwen3-*-FP8: config.json's ``quantization_config``, ``quantization_method``):
each q/k/v/o/gate/up/down projection stores ``weight`` float8_e4m3fn [N, K] and
``weight_scale_inv`` fp32 [ceil(N/128), ceil(K/128)] (one per 128 x 128 block; it multiplies);
e4m3 tensors load only into e4m3 parameters, and every scale must be finite and > 0.

FP8 KV cache scales (vLLM / llm-compressor FP8-KV checkpoints; optional): ``model.layers.{i}.
self_attn.k_scale`` and ``.v_scale``, one fp32 value each, go into layer i's Attention
(``k_scale`` / ``v_scale``) when the engine runs an fp8 cache (``apply_kv_scales``); each must be
one finite value > 0 either way. Every tensor-parallel rank reads the same value.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

import torch
from torch import nn

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)
SUPPORTED_MODEL_TYPES = ("qwen3",)
INDEX_FILE = "model.safetensors.index.json"
# Tensors some exporters write that carry nothing the model needs.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# a layer's fp8 KV cache scales: not parameters (Python floats the ops take), so loaded apart
KV_SCALE_SUFFIXES = ("self_attn.k_scale", "self_attn.v_scale")


class CheckpointError(ValueError):
    """A checkpoint folder this model cannot load; the message names the file or tensor."""


def read_config(path: str | os.PathLike) -> dict:
    """Read and check ``path/config.json`` without transformers: the architecture, and every size
    the model is built from (``config_fields``). Returns the JSON object as stored."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint folder {str(path)!r} does not exist or is not a "
                              "directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"no config.json in {str(path)!r}: expected a Hugging Face "
                              "checkpoint folder")
    try:
        raw = json.loads(config_file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{config_file} is not UTF-8 text: {e}") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_file} is not valid JSON: {e}") from e
    except OSError as e:
        raise CheckpointError(f"{config_file} cannot be read: {e}") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_file}: expected a JSON object, got "
                              f"{type(raw).__name__}")
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{config_file}: model_type is {model_type!r}, expected 'qwen3' "
            f"(architectures: {archs}); "
            "only dense Qwen3 checkpoints are supported"
        )
    if archs and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise CheckpointError(
            f"{config_file}: architectures is {archs}, expected {list(SUPPORTED_ARCHITECTURES)}"
        )
    config_fields(raw, config_file)
    quantization_method(raw, config_file)
    return raw


# the sizes the model is built from: integers >= 1 (head_dim: or absent / null)
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim",
               "max_position_embeddings")


def _qwen3_defaults() -> dict:
    """Qwen3Config's defaults for the fields a config.json may leave out."""
    import inspect

    from transformers import Qwen3Config

    params = inspect.signature(Qwen3Config.__init__).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def _rope_theta(fields: dict):
    for key in ("rope_parameters", "rope_scaling"):
        params = fields.get(key)
        if isinstance(params, dict) and "rope_theta" in params:
            return params["rope_theta"]
    return fields.get("rope_theta", 10000.0)


def config_fields(raw: dict, where) -> dict:
    """The model's sizes from a config.json object (Qwen3Config's defaults for those left out,
    head_dim resolved), each checked for type, sign and range; a CheckpointError naming ``where``
    and the field otherwise. Cheap whatever the values (nothing is allocated)."""
    fields = {**_qwen3_defaults(), **raw}

    def bad(name, expected):
        raise CheckpointError(f"{where}: {name} must be {expected}, got {fields.get(name)!r}")

    for name in SIZE_FIELDS:
        v = fields.get(name)
        if name == "head_dim" and v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            bad(name, "an integer >= 1")
    if fields.get("head_dim") is None:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
        if fields["head_dim"] < 1:
            raise CheckpointError(
                f"{where}: head_dim is not given and hidden_size // num_attention_heads "
                f"({fields['hidden_size']} // {fields['num_attention_heads']}) is 0")
    if fields["head_dim"] % 2:
        bad("head_dim", "even (rotary embedding rotates pairs)")
    heads, kv = fields["num_attention_heads"], fields["num_key_value_heads"]
    if heads % kv:
        raise CheckpointError(f"{where}: num_attention_heads ({heads}) must be a multiple of "
                              f"num_key_value_heads ({kv})")
    eps = fields.get("rms_norm_eps")
    if not _is_number(eps) or not 0 < eps < 1:
        bad("rms_norm_eps", "a number in (0, 1)")
    theta = _rope_theta(fields)
    if not _is_number(theta) or not 0 < theta < float("inf"):
        raise CheckpointError(f"{where}: rope_theta must be a finite number > 0, got {theta!r}")
    return fields


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # (not NaN)


# The FP8 format this model runs (Qwen3-*-FP8's quantization_config): e4m3 weights with one scale
# per 128 x 128 block, activations quantized per token per 128-wide group at run time.
FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}
# the modules stored in FP8 (the rest, embeddings, norms and lm_head, stay bf16)
FP8_PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
                   "mlp": ("gate_proj", "up_proj", "down_proj")}
FP8_SCALE = "weight_scale_inv"  # the checkpoint's name of a projection's block scales
# config keys that list modules left unquantized (Hugging Face's and vLLM's names)
UNQUANTIZED_LISTS = ("modules_to_not_convert", "ignored_layers")


def quantization_method(raw: dict, where) -> str | None:
    """None for a checkpoint without ``quantization_config``, "fp8" for Qwen's FP8 format
    (``FP8_QUANTIZATION``); anything else a CheckpointError naming ``where`` and the field.

    A list of modules left unquantized (``UNQUANTIZED_LISTS``) may name modules that are bf16
    anyway (lm_head, embeddings, norms); one that matches a projection is refused: the model
    runs every projection in FP8."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise CheckpointError(f"{where}: quantization_config must be a JSON object, got "
                              f"{type(qc).__name__}")
    supported = f"supported: {FP8_QUANTIZATION}"
    for key, want in FP8_QUANTIZATION.items():
        # activation_scheme and fmt have these values when absent (transformers' FP8 config)
        if key in ("activation_scheme", "fmt") and key not in qc:
            continue
        if qc.get(key) != want:
            raise CheckpointError(f"{where}: quantization_config.{key} is {qc.get(key)!r}, "
                                  f"expected {want!r} ({supported})")
    for key in UNQUANTIZED_LISTS:
        names = qc.get(key) or []
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise CheckpointError(f"{where}: quantization_config.{key} must be a list of module "
                                  f"names, got {names!r}")
        for name in names:
            hit = _unquantized_projection(name, raw.get("num_hidden_layers"))
            if hit:
                raise CheckpointError(
                    f"{where}: quantization_config.{key} names {name!r}, which matches the "
                    f"projection {hit!r}: a projection kept in bf16 within an FP8 checkpoint is "
                    "not supported (every q/k/v/o/gate/up/down projection must be FP8)")
    return "fp8"


def _unquantized_projection(entry: str, num_layers) -> str | None:
    """The first projection module ``entry`` matches as transformers matches these lists (a
    substring of the module's name, or the name a prefix of it), or None."""
    if not entry:
        return None
    layers = num_layers if isinstance(num_layers, int) and num_layers > 0 else 1
    for i in range(layers):
        for block, projs in FP8_PROJECTIONS.items():
            for proj in projs:
                module = f"model.layers.{i}.{block}.{proj}"
                if entry in module or entry.startswith(module + "."):
                    return module
    return None


def load_hf_config(path: str | os.PathLike):
    """Read and check ``path/config.json`` (``read_config``); returns a transformers
    ``Qwen3Config``, its values checked again as transformers resolved them."""
    path = Path(path)
    read_config(path)
    config_file = path / "config.json"
    from transformers import Qwen3Config

    try:
        cfg = Qwen3Config.from_pretrained(str(path))
    except Exception as e:  # transformers validates field values (e.g. layer_types vs layers)
        raise CheckpointError(f"{config_file}: transformers rejects this Qwen3 config: {e}") from e
    config_fields(cfg.to_dict(), config_file)
    return cfg


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The checkpoint's safetensors files: those named by the index if there is one, else all."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map")
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names files that are not in {str(path)!r}: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        others = (sorted(p.name for p in path.glob("*.bin"))
                  + sorted(p.name for p in path.glob("*.pt")))
        hint = f" (found {others}: only safetensors is supported)" if others else ""
        raise CheckpointError(f"no *.safetensors files in {str(path)!r}{hint}")
    return files


def _target(name: str, packed: dict) -> tuple[str, object]:
    """Checkpoint tensor name -> (our parameter name, shard id or None), via
    packed_modules_mapping."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            fused, shard_id = packed[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1 :]), shard_id
    return name, None


def _checkpoint_names(param_name: str, shard_ids, packed: dict) -> list[str]:
    """The checkpoint tensors a parameter (or its missing shards) is made of: for error messages."""
    if not shard_ids:
        return [param_name]
    parts = param_name.split(".")
    out = []
    for src, (fused, sid) in packed.items():
        if fused in parts and sid in shard_ids:
            i = parts.index(fused)
            out.append(".".join(parts[:i] + [src] + parts[i + 1 :]))
    return out


# what a checkpoint tensor may be stored as: cast to the parameter's dtype on load. Anything else
# (integers, bool, other fp8 formats) is refused, never cast silently; float8_e4m3fn loads only
# into an e4m3 parameter (an FP8 checkpoint's projection weights), bit for bit.
LOADABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
FP8_DTYPE = torch.float8_e4m3fn


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@contextlib.contextmanager
def _open_safetensors(file: Path):
    """safe_open(file), its failures (truncated, garbage, unreadable) a CheckpointError naming
    the file."""
    from safetensors import safe_open

    try:
        f = safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # safetensors' own error type, OSError
        raise CheckpointError(f"{file} is not a readable safetensors file: {e}") from e
    with f:
        yield f


def _read_tensor(f, name: str, file: Path, param: nn.Parameter) -> torch.Tensor:
    try:
        tensor = f.get_tensor(name)
    except Exception as e:  # data past the end of a truncated file, a dtype torch lacks
        raise CheckpointError(f"tensor {name!r} in {file}: cannot be read: {e}") from e
    where = f"tensor {name!r} in {file}: dtype {_dtype_name(tensor.dtype)}"
    if param.dtype == FP8_DTYPE:
        if tensor.dtype != FP8_DTYPE:
            raise CheckpointError(
                f"{where}, expected float8_e4m3fn: config.json's quantization_config is FP8, "
                "so every projection weight is stored in e4m3 next to its weight_scale_inv")
        return tensor
    if tensor.dtype == FP8_DTYPE:
        raise CheckpointError(
            f"{where}, expected {_dtype_name(param.dtype)} (the model's parameter): FP8 "
            "weights load only into the projections of a checkpoint whose config.json has "
            f"quantization_config {FP8_QUANTIZATION}")
    if tensor.dtype not in LOADABLE_DTYPES:
        raise CheckpointError(
            f"{where}, expected one of {[_dtype_name(d) for d in LOADABLE_DTYPES]} "
            "(integer checkpoints and other quantization formats are not supported)")
    return tensor


@torch.no_grad()
def load_model(model: nn.Module, path: str | os.PathLike, check_finite: bool = True,
               apply_kv_scales: bool = False) -> None:
    """Fill every parameter of ``model`` from the safetensors in ``path`` (this rank's slices).

    Errors (CheckpointError, naming the file and the tensor): a file that is not safetensors or is
    truncated, a tensor the model has no place for, of the wrong shape, of a dtype that is not
    floating point (``LOADABLE_DTYPES``; float8_e4m3fn exactly where the parameter is), found
    twice, or holding NaN / Inf or a block scale <= 0 (``check_finite``); a parameter the
    checkpoint does not provide (a projection's ``weight_scale_inv`` included).
    With tied embeddings a stored ``lm_head.weight`` is skipped: the head reads the embedding.

    A layer's optional ``self_attn.k_scale`` / ``v_scale`` must be one finite value > 0 (a
    CheckpointError naming it otherwise); ``apply_kv_scales`` (an fp8 KV cache) puts them in the
    layer's Attention, else they are checked only: the cache holds values as they are.

    The NaN / Inf check reduces each parameter on its device (one flag) and reads all the
    results at once at the end: one synchronisation per load.
    """
    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())
    tied = bool(getattr(model, "tie_word_embeddings", False))
    # parameter name -> shard ids still expected ({None} for a plain parameter)
    pending = {n: set(getattr(p, "shard_ids", (None,))) for n, p in params.items()}
    seen: dict[str, str] = {}
    sources: dict[str, list[tuple[str, Path]]] = {}  # parameter -> its checkpoint tensors

    for file in safetensors_files(path):
        with _open_safetensors(file) as f:
            for name in f.keys():
                if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                if name in seen:
                    raise CheckpointError(f"tensor {name!r} appears twice: in {seen[name]} and "
                                          f"{file.name}")
                seen[name] = file.name
                if name.endswith(KV_SCALE_SUFFIXES):
                    _load_kv_scale(model, f, name, file, apply_kv_scales)
                    continue
                pname, shard_id = _target(name, packed)
                param = params.get(pname)
                if param is None:
                    hint = ("an FP8 block scale, but config.json has no FP8 quantization_config"
                            if name.endswith(FP8_SCALE) else
                            "is this a Qwen3 dense checkpoint matching config.json?")
                    raise CheckpointError(
                        f"unexpected tensor {name!r} in {file.name}: the model has no "
                        f"parameter {pname!r} ({hint})"
                    )
                loader = getattr(param, "weight_loader", None)
                if shard_id is None and getattr(param, "shard_ids", None):
                    raise CheckpointError(
                        f"tensor {name!r} in {file.name}: {pname!r} is fused from "
                        f"{_checkpoint_names(pname, set(param.shard_ids), packed)}; "
                        "expected those tensors"
                    )
                tensor = _read_tensor(f, name, file, param)
                try:
                    if shard_id is None:
                        if loader is None:
                            if tuple(tensor.shape) != tuple(param.shape):
                                raise ValueError(f"expected shape {tuple(param.shape)}, "
                                                 f"got {tuple(tensor.shape)}")
                            param.data.copy_(tensor)
                        else:
                            loader(param, tensor)
                    else:
                        loader(param, tensor, shard_id)
                except (ValueError, RuntimeError) as e:  # RuntimeError: a copy_ of other shape
                    raise CheckpointError(f"tensor {name!r} in {file.name}: {e}") from e
                pending[pname].discard(shard_id)
                sources.setdefault(pname, []).append((name, file))
                del tensor

    missing = [
        ckpt
        for pname, shards in pending.items()
        if shards
        for ckpt in _checkpoint_names(pname, shards - {None}, packed)
    ]
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        shown = ", ".join(repr(m) for m in missing[:8]) + more
        raise CheckpointError(f"checkpoint {str(path)!r} is missing {len(missing)} tensor(s): "
                              f"{shown}")
    if check_finite:
        _check_finite(params, sources)


def _load_kv_scale(model: nn.Module, f, name: str, file: Path, apply: bool) -> None:
    """``model.layers.{i}.self_attn.k_scale`` (or v_scale): one finite value > 0, set on the
    layer's Attention (``self_attn.attn``) as a Python float where ``apply``."""
    owner, attr = name.rsplit(".", 1)
    try:
        attn = model.get_submodule(owner + ".attn")
    except AttributeError:  # a layer the config does not have, or no such module
        attn = None
    if not hasattr(attn, attr):
        raise CheckpointError(f"unexpected tensor {name!r} in {file.name}: the model has no "
                              f"attention layer {owner!r} (is this a Qwen3 dense checkpoint "
                              "matching config.json?)")
    try:
        t = f.get_tensor(name)
    except Exception as e:  # as _read_tensor
        raise CheckpointError(f"tensor {name!r} in {file}: cannot be read: {e}") from e
    where = f"tensor {name!r} in {file}"
    expected = "one fp32 value > 0 (the layer's fp8 KV cache scale)"
    if t.dtype not in LOADABLE_DTYPES or t.numel() != 1:
        raise CheckpointError(f"{where}: dtype {_dtype_name(t.dtype)}, shape {tuple(t.shape)}; "
                              f"expected {expected}")
    value = t.float().item()  # the ops take it as fp32
    if not (math.isfinite(value) and value > 0):
        raise CheckpointError(f"{where}: {value}, expected {expected}")
    if apply:
        setattr(attn, attr, value)


def _check_finite(params: dict[str, nn.Parameter],
                  sources: dict[str, list[tuple[str, Path]]]) -> None:
    """Refuse NaN / Inf in any loaded parameter (and a block scale that is not > 0), naming the
    first checkpoint tensor that has one.

    Each parameter is reduced to one flag on its own device: floating point through its (min,
    max) (NaN propagates through both; an Inf is the min or the max; a ``weight_scale_inv`` also
    needs min > 0), e4m3 through its bits (no Inf in e4m3fn; NaN is S1111111). The flags are
    stacked and read back once."""
    names = [n for n, p in params.items() if p.numel()]
    if not names:
        return
    ok = torch.stack([_valid(n, params[n]) for n in names]).tolist()  # the one synchronisation
    for name, good in zip(names, ok):
        if good:
            continue
        # the error path: find which of the parameter's checkpoint tensors holds it (host reads)
        for ckpt_name, file in sources.get(name, []):
            with _open_safetensors(file) as f:
                t = f.get_tensor(ckpt_name)
            masks = _bad_values(ckpt_name, t)
            bad = torch.zeros(t.shape, dtype=torch.bool)
            for m in masks.values():
                bad |= m
            kinds = [k for k, m in masks.items() if m.any()]
            if kinds:
                first = tuple(int(i) for i in bad.nonzero()[0])
                raise CheckpointError(
                    f"tensor {ckpt_name!r} in {file}: {int(bad.sum()):,} of {t.numel():,} "
                    f"values are {' / '.join(kinds)} (the first at index {first})")
        raise CheckpointError(f"parameter {name!r}: holds NaN or Inf after loading (from "
                              f"{[n for n, _ in sources.get(name, [])]}: finite as stored; "
                              "out of range of the model's dtype?)")


def _is_fp8_nan(t: torch.Tensor) -> torch.Tensor:
    return (t.view(torch.uint8) & 0x7F) == 0x7F


def _valid(name: str, p: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool on p's device: no NaN / Inf (and all > 0 for a block scale)."""
    if p.dtype == FP8_DTYPE:
        return ~_is_fp8_nan(p).any()
    lo, hi = p.aminmax()
    good = torch.stack([lo, hi]).float().isfinite().all()
    return good & (lo > 0) if name.endswith(FP8_SCALE) else good


def _bad_values(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """Masks of the values ``_valid`` refuses in a checkpoint tensor, by kind."""
    if t.dtype == FP8_DTYPE:
        return {"NaN": _is_fp8_nan(t)}
    kinds = {"NaN": t.isnan(), "Inf": t.isinf()}
    if name.endswith(FP8_SCALE):
        kinds["<= 0 (a block scale must be > 0)"] = t <= 0
    return kinds
