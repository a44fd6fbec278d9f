# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Writes the small intersphinx inventories the documentation links against.

The documentation builds without network access, so intersphinx cannot download
the ``objects.inv`` of Python, PyTorch, tensordict and TorchRL. Instead,
``conf.py`` points intersphinx at the real online documentation and reads the
inventory from the files written here. They list the external objects that these
pages and the package's docstrings reference, and a few close neighbours; each URI
is the page where the upstream documentation renders that object.

When a page or a docstring starts referencing another external object, the
nitpicky build fails on it: add the object to ``INVENTORIES`` and run::

    python docs/source/_inv/make_inventories.py

The files follow Sphinx's inventory format (version 2): four plain header lines,
then one zlib-compressed line per object, ``name domain:role priority uri
dispname``, where a URI ending in ``$`` stands for the object's name and the
display name ``-`` for the name itself.
"""

from __future__ import annotations

import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent

# file stem -> (project, version, [(name, "domain:role", uri), ...])
INVENTORIES: dict[str, tuple[str, str, list[tuple[str, str, str]]]] = {
    "python": (
        "Python",
        "3",
        [
            ("bool", "py:class", "library/functions.html#$"),
            ("collections.abc.Callable", "py:class", "library/collections.abc.html#$"),
            ("collections.abc.Collection", "py:class", "library/collections.abc.html#$"),
            ("collections.abc.Iterable", "py:class", "library/collections.abc.html#$"),
            ("collections.abc.Iterator", "py:class", "library/collections.abc.html#$"),
            ("collections.abc.Sequence", "py:class", "library/collections.abc.html#$"),
            ("dict", "py:class", "library/stdtypes.html#$"),
            ("float", "py:class", "library/functions.html#$"),
            ("int", "py:class", "library/functions.html#$"),
            ("list", "py:class", "library/stdtypes.html#$"),
            ("str", "py:class", "library/stdtypes.html#$"),
            ("tuple", "py:class", "library/stdtypes.html#$"),
            ("None", "py:data", "library/constants.html#$"),
            ("KeyError", "py:exception", "library/exceptions.html#$"),
            ("UserWarning", "py:exception", "library/exceptions.html#$"),
            ("ValueError", "py:exception", "library/exceptions.html#$"),
            ("typing.Literal", "py:data", "library/typing.html#$"),
        ],
    ),
    "torch": (
        "PyTorch",
        "stable",
        [
            ("torch.Tensor", "py:class", "tensors.html#$"),
            ("torch.Size", "py:class", "size.html#$"),
            ("torch.dtype", "py:class", "tensor_attributes.html#$"),
            ("torch.no_grad", "py:class", "generated/torch.no_grad.html#$"),
            ("torch.nn.Module", "py:class", "generated/torch.nn.Module.html#$"),
            ("torch.compile", "py:function", "generated/torch.compile.html#$"),
            ("torch.distributed.ProcessGroup", "py:class", "distributed.html#$"),
            (
                "torch.distributed.fsdp.fully_shard",
                "py:function",
                "distributed.fsdp.fully_shard.html#$",
            ),
            ("torch.optim.Optimizer", "py:class", "optim.html#$"),
        ],
    ),
    "tensordict": (
        "tensordict",
        "stable",
        [
            (name, role, f"reference/generated/{name}.html#$")
            for name, role in (
                ("tensordict.TensorDictBase", "py:class"),
                ("tensordict.TensorDict", "py:class"),
                ("tensordict.LazyStackedTensorDict", "py:class"),
                ("tensordict.lazy_stack", "py:function"),
            )
        ],
    ),
    "torchrl": (
        "torchrl",
        "stable",
        [
            (name, "py:class", f"reference/generated/{name}.html#$")
            for name in (
                "torchrl.collectors.llm.LLMCollector",
                "torchrl.data.ReplayBuffer",
                "torchrl.data.replay_buffers.LazyStackStorage",
                "torchrl.envs.llm.ChatEnv",
                "torchrl.envs.transforms.Transform",
                "torchrl.modules.llm.LLMWrapperBase",
                "torchrl.modules.llm.TransformersWrapper",
                "torchrl.modules.llm.vLLMWrapper",
                "torchrl.objectives.LossModule",
                "torchrl.objectives.llm.CISPOLoss",
                "torchrl.objectives.llm.DAPO",
                "torchrl.objectives.llm.GRPOLoss",
                "torchrl.objectives.llm.GRPOLossOutput",
                "torchrl.objectives.llm.LLMLossOutput",
                "torchrl.objectives.llm.MCAdvantage",
                "torchrl.trainers.MixedPrecisionOptimizationStepper",
                "torchrl.trainers.OptimizationStepper",
                "torchrl.trainers.Trainer",
                "torchrl.trainers.TrainerHookBase",
                "torchrl.trainers.algorithms.grpo.GRPOTrainer",
            )
        ]
        + [
            (
                "torchrl.objectives.LossModule.set_keys",
                "py:method",
                "reference/generated/torchrl.objectives.LossModule.html#$",
            ),
        ],
    ),
}


def inventory_bytes(project: str, version: str, objects: list[tuple[str, str, str]]) -> bytes:
    """Returns the content of a version-2 Sphinx inventory listing ``objects``."""
    header = (
        "# Sphinx inventory version 2\n"
        f"# Project: {project}\n"
        f"# Version: {version}\n"
        "# The remainder of this file is compressed using zlib.\n"
    )
    body = "".join(f"{name} {role} 1 {uri} -\n" for name, role, uri in sorted(objects))
    return header.encode() + zlib.compress(body.encode(), 9)


def main() -> None:
    for stem, (project, version, objects) in INVENTORIES.items():
        path = HERE / f"{stem}.inv"
        path.write_bytes(inventory_bytes(project, version, objects))
        print(f"{path.name}: {len(objects)} objects")


if __name__ == "__main__":
    main()
