"""GGUF checkpoints as models: a `.gguf` file (or a directory holding exactly one) becomes an
ordinary Hugging Face model directory, converted once and cached.

    from gspo.models.gguf import gguf_source, converted
    src = gguf_source(Path("SmolLM2-135M-Instruct.Q4_1.gguf"))   # the file, or None for a model directory
    path = converted(src)         # ~/.cache/gspo/gguf/<sha256[:16]>-<stem>/: config, tokenizer, safetensors

transformers reads GGUF files (`from_pretrained(dir, gguf_file=name)`, with the `gguf`
package): it dequantises every tensor (Q4_1, Q8_0, K-quants ...) to a float dtype and rebuilds
the config, the tokenizer and its chat template from the file's metadata. That costs about 20 s
for a 135M model (minutes for 7B), so gspo pays it once: the dequantised model is saved in
float32 (the dequantised values exactly; a 135M model takes 0.5 GB) with its tokenizer under
the cache directory ($GSPO_CACHE, else $XDG_CACHE_HOME/gspo, else ~/.cache/gspo), keyed by the
file's content (sha256; a stat record skips rehashing an unchanged file). From there on every
part of gspo (policy, frozen reference, PPO's critic, rollout workers, `gspo eval`, `gspo
export`, the vLLM engine) reads that directory as it reads any model directory. A conversion is
written to a temporary directory and renamed into place, so a killed conversion leaves nothing
half-written behind; a lock in the cache (fcntl) makes torchrun's ranks, or two runs, starting at
once convert once while the others wait.

One line each: the `gguf` package missing (pip install 'gspo[gguf]'), a file that is not GGUF
or is cut short, an architecture transformers cannot read from GGUF, an encoder model.

Left out: GGUF files on the Hub (`org/name` with a file name), sharded GGUF (`-00001-of-00003`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

GGUF = ".gguf"
INFO = "gguf.json"  # in a converted directory: where it came from (file, sha256, architecture, quantisation)


class GGUFError(ValueError):
    """A GGUF file that cannot be loaded; the message is one line naming it (a ValueError, as
    gspo.models.loading.ModelError: this module is a leaf that gspo.models.loading imports)."""


def cache_root() -> Path:
    """Where converted models live: $GSPO_CACHE/gguf, $XDG_CACHE_HOME/gspo/gguf or ~/.cache/gspo/gguf."""
    base = os.environ.get("GSPO_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gspo"
    return Path(base).expanduser() / "gguf"


def gguf_source(path: Path, name: str | None = None) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one `.gguf` file of a directory that
    is not a model directory (no config.json, no adapter_config.json); None otherwise."""
    name = name or str(path)
    if path.is_file():
        return path if path.name.lower().endswith(GGUF) else None
    if not path.is_dir() or (path / "config.json").exists() or (path / "adapter_config.json").exists():
        return None
    files = sorted(p for p in path.iterdir() if p.name.lower().endswith(GGUF) and p.is_file())
    if len(files) > 1:
        shown = ", ".join(p.name for p in files[:4]) + (", ..." if len(files) > 4 else "")
        raise GGUFError(f"model {name}: {len(files)} GGUF files ({shown}); "
                        f"name one of them: --model {path / files[0].name}")
    return files[0] if files else None


def header(path: Path) -> dict:
    """What the file says about itself, without dequantising: architecture, model name, main
    quantisation type (by parameter count), parameter count. One line if it is not GGUF."""
    reader = _reader(path)
    arch = _field(reader, "general.architecture") or "unknown"
    by_type: dict[str, int] = {}
    for t in reader.tensors:
        kind = getattr(t.tensor_type, "name", str(t.tensor_type))
        by_type[kind] = by_type.get(kind, 0) + int(t.n_elements)
    total = sum(by_type.values())
    main = max(by_type, key=by_type.get) if by_type else "unknown"
    return {"architecture": arch, "name": _field(reader, "general.name"), "quantization": main,
            "types": {k: round(v / total, 4) for k, v in sorted(by_type.items(), key=lambda kv: -kv[1])},
            "parameters": total}


def _reader(path: Path):
    try:
        from gguf import GGUFReader
    except ImportError:
        raise GGUFError(f"model {path}: reading a GGUF file needs the gguf package: pip install 'gspo[gguf]' "
                        "(or pip install gguf)") from None
    try:
        return GGUFReader(path)
    except Exception as e:  # bad magic, a file cut short (numpy's memmap or struct errors), a bad version
        detail = " ".join(str(e).split())[:160]
        raise GGUFError(f"model {path}: not a readable GGUF file ({type(e).__name__}: {detail}); "
                        "is it complete?") from None


def _field(reader, key: str):
    """A string field of the GGUF metadata, or None."""
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    try:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except (UnicodeDecodeError, TypeError, ValueError):
        return None


ENCODERS = ("t5", "t5encoder", "umt5", "bert", "nomic-bert", "jina-bert-v2")


def check_architecture(path: Path, arch: str) -> None:
    """One line unless transformers can read `arch` from GGUF as a causal LM."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if arch in ENCODERS:
        raise GGUFError(f"model {path}: GGUF architecture {arch!r} is an encoder or encoder-decoder model, "
                        "not a causal (decoder) language model")
    readable = [a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer") and a not in ENCODERS]
    aliases = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}
    if arch not in readable and aliases.get(arch) not in readable:
        import transformers

        raise GGUFError(f"model {path}: GGUF architecture {arch!r} cannot be read by transformers "
                        f"{transformers.__version__} (it reads {', '.join(readable)}); convert the original "
                        "checkpoint instead")


def content_hash(path: Path) -> str:
    """sha256 of the file, remembered by (path, size, mtime) under the cache so an unchanged file
    is not read again."""
    st = path.stat()
    stamp = hashlib.sha1(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    memo = cache_root() / "hashes" / stamp
    try:
        known = memo.read_text().strip()
        if len(known) == 64:
            return known
    except OSError:
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    digest = h.hexdigest()
    try:  # whole or absent: another process may be reading it
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(digest)
        os.replace(tmp, memo)
    except OSError:  # a read-only cache: hash again next time
        pass
    return digest


def converted(src: Path, log=None) -> Path:
    """The model directory converted from the GGUF file `src` (converting it the first time;
    `log` gets one line saying so). Raises GGUFError (one line)."""
    digest = content_hash(src)
    out = cache_root() / f"{digest[:16]}-{src.name[:-len(GGUF)]}"
    if (out / INFO).exists():  # converted before: every later start (and every later part of a run) ends here
        return out
    info = header(src)
    check_architecture(src, info["architecture"])
    out.parent.mkdir(parents=True, exist_ok=True)
    with _lock(out):  # torchrun's ranks, or two runs, starting at once: one converts, the others wait and read it
        if (out / INFO).exists():
            return out
        if log:
            log(f"model {src}: converting the GGUF file ({info['architecture']}, {info['quantization']}) to a "
                f"float32 model directory, once: {out}")
        _convert_into(src, out, {"source": str(src.resolve()), "sha256": digest, **info})
    return out


@contextlib.contextmanager
def _lock(out: Path):
    """An exclusive lock on `<out>.lock` (fcntl; where there is none, no lock: the rename below
    still keeps one whole copy)."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    with open(out.parent / f".{out.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert_into(src: Path, out: Path, info: dict) -> None:
    """Convert `src` into a temporary directory beside `out`, then rename it into place."""
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=out.parent))
    try:
        _convert(src, tmp)
        (tmp / INFO).write_text(json.dumps(info, indent=1) + "\n")
        tmp.chmod(0o755)  # mkdtemp's 0700: a shared cache is read by others too
        try:
            tmp.rename(out)
        except OSError:  # another process converted it meanwhile: keep theirs
            if not (out / INFO).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert(src: Path, dest: Path) -> None:
    """Dequantise `src` with transformers and save model, generation config and tokenizer in `dest`."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    where, name = src.parent, src.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    except Exception as e:
        detail = " ".join(str(e).split())[:200]
        raise GGUFError(f"model {src}: transformers could not load it ({type(e).__name__}: {detail})") from None
    # the weights are plain float32 now; transformers still marks the model quantised "with gguf"
    # (and refuses to save it): a directory loaded again is an ordinary model
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = str(src.resolve())
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def source_info(path: Path) -> dict | None:
    """For a converted directory, what gguf.json records (source file, architecture,
    quantisation ...); None for any other model directory."""
    try:
        return json.loads((Path(path) / INFO).read_text())
    except (OSError, ValueError):
        return None


def describe(info: dict) -> str:
    """'GGUF llama Q4_1 (134.5M parameters), dequantised to float32 once'."""
    n = info.get("parameters", 0)
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    return (f"GGUF {info.get('architecture')} {info.get('quantization')} ({size} parameters), "
            "dequantised to float32 once")
