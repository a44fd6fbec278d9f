# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Sphinx configuration of the torchrl_gspo documentation.

Build (from the repository root)::

    pip install -r docs/requirements.txt
    sphinx-build -W --keep-going -b html docs/source docs/_build/html

The build needs no network: intersphinx reads the small inventories committed
under ``_inv/`` (see ``_inv/make_inventories.py``) and MathJax is served from
the ``sphinx-mathjax-offline`` package.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from sphinx.ext import intersphinx
from sphinx.ext.autodoc.preserve_defaults import update_defvalue
from sphinx.util import inspect as sphinx_inspect
from torchrl.objectives import LossModule
from torchrl.objectives.llm import LLMLossOutput

import torchrl_gspo

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent

# -- Project information -----------------------------------------------------

project = "torchrl_gspo"
copyright = "torchrl_gspo contributors"
author = "torchrl_gspo contributors"
version = release = torchrl_gspo.__version__
language = "en"

# -- General configuration ---------------------------------------------------

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.intersphinx",
    "sphinx.ext.mathjax",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",
    # Copies MathJax 3 into _static/mathjax and points mathjax_path at it.
    "sphinx-mathjax-offline",
    "sphinx_copybutton",
]

# The copy button leaves out the ">>> " / "... " prompts and the output of examples.
copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True
copybutton_only_copy_prompt_lines = False

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
master_doc = "index"
templates_path = ["_templates"]
exclude_patterns = ["_build", "_inv"]

# Every cross-reference must resolve: a dangling one fails the (-W) build.
nitpicky = True
nitpick_ignore_regex = [
    # String literals inside ``Literal[...]`` type annotations are values, not objects.
    (r"py:(class|data|obj)", r"""^(['"]).*\1$"""),
]
nitpick_ignore = [
    # The Google-style "(type, optional)" marker.
    ("py:class", "optional"),
    ("py:obj", "optional"),
    # A private hook named in GSPOLoss' docstring; it has no page of its own.
    ("py:meth", "_log_weight"),
    # tensordict's key type alias (str or tuple of str) has no documentation page.
    ("py:class", "NestedKey"),
    ("py:class", "tensordict._nestedkey.NestedKey"),
    # numpy is not among the offline inventories (_inv/).
    ("py:class", "numpy.ndarray"),
    ("py:class", "np.ndarray"),
    # TorchRL's PolicyVersion transform is not in TorchRL's API docs (no page).
    ("py:class", "PolicyVersion"),
    ("py:class", "torchrl.envs.llm.transforms.PolicyVersion"),
    ("py:class", "torchrl.envs.llm.transforms.policy_version.PolicyVersion"),
    # torch's hook handle is not in torch's API docs (no page).
    ("py:class", "RemovableHandle"),
    ("py:class", "torch.utils.hooks.RemovableHandle"),
]

# -- autodoc / autosummary / napoleon ------------------------------------------

autosummary_generate = True
autodoc_member_order = "bysource"
autodoc_preserve_defaults = True
autodoc_typehints = "signature"

napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = False  # one anchor per attribute

# -- intersphinx ---------------------------------------------------------------
# Links point at the online documentation; the inventories are read from _inv/
# because the build runs offline.

# TorchRL publishes its docs per release (docs.pytorch.org/rl/<version>/): links go to
# the 0.14 series this package pins. tensordict's docs were found only as "stable",
# and torch is a range (>= 2.13), not a pin: those links go to the stable docs.
intersphinx_mapping = {
    "python": ("https://docs.python.org/3/", "_inv/python.inv"),
    "torch": ("https://docs.pytorch.org/docs/stable/", "_inv/torch.inv"),
    "tensordict": ("https://docs.pytorch.org/tensordict/stable/", "_inv/tensordict.inv"),
    "torchrl": ("https://docs.pytorch.org/rl/0.14/", "_inv/torchrl.inv"),
}

# -- MyST (validation.md includes the repository's VALIDATION.md) --------------

myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3

# -- HTML output ---------------------------------------------------------------

html_theme = "pydata_sphinx_theme"
html_title = f"torchrl_gspo {version}"
html_static_path = ["_static"]
html_css_files = ["css/custom.css"]
html_show_sourcelink = False
# The user guide pages have no sub-pages: give their width to the text.
_GUIDE_PAGES = (
    "index",
    "getting_started",
    "tutorial",
    "math",
    "scaling",
    "migration",
    "troubleshooting",
    "validation",
)
html_sidebars = {page: [] for page in _GUIDE_PAGES}
html_theme_options = {
    "navigation_with_keys": False,
    "navbar_align": "left",
    "show_prev_next": True,
    # The API pages hold one class each: no "on this page" column there.
    "secondary_sidebar_items": {page: ["page-toc"] for page in (*_GUIDE_PAGES, "reference")},
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
    "icon_links": [
        {
            "name": "Paper (arXiv:2507.18071)",
            "url": "https://arxiv.org/abs/2507.18071",
            "icon": "fa-solid fa-file-lines",
        },
    ],
}
htmlhelp_basename = "torchrl_gspo_doc"


# -- Markdown files included from the repository root ----------------------------
# validation.md includes VALIDATION.md under its own title. That file links
# files relative to the repository root: rewrite those targets so that images and
# downloads resolve from the including page, and drop its top-level title.

_MD_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
_MD_REF_DEF = re.compile(r"^(\s{0,3}\[[^\]]+\]:\s+)(\S+)", re.MULTILINE)
_EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|#|/)", re.IGNORECASE)
_MD_TITLE = re.compile(r"\A\s*(?:#[ \t]+[^\n]*|[^\n]+\n=+[ \t]*)(?:\n|\Z)")


def _rebase_markdown_target(target: str, prefix: str) -> str:
    if _EXTERNAL.match(target):
        return target
    path, _, anchor = target.partition("#")
    if not (REPO_ROOT / path).exists():
        return target  # left as is: the build reports the broken link
    return prefix + path + (f"#{anchor}" if anchor else "")


def _rebase_included_markdown(app, relative_path, parent_docname, content) -> None:
    path = (Path(app.srcdir) / relative_path).resolve()
    if path.suffix != ".md" or path.parent != REPO_ROOT:
        return
    source_dir = (Path(app.srcdir) / parent_docname).parent
    prefix = os.path.relpath(REPO_ROOT, source_dir).replace(os.sep, "/") + "/"
    text = content[0]
    text = _MD_LINK.sub(lambda m: m[1] + _rebase_markdown_target(m[2], prefix) + m[3], text)
    text = _MD_REF_DEF.sub(lambda m: m[1] + _rebase_markdown_target(m[2], prefix), text)
    content[0] = _MD_TITLE.sub("", text, count=1)


# -- Public paths of external objects ---------------------------------------------
# Type hints and base classes name external objects by the module that defines
# them (``torchrl.objectives.llm.grpo.GRPOLoss``) or by a bare name
# (``Literal``); their documentation lists them under their public path.

_PUBLIC_PATHS = {
    "Literal": "typing.Literal",
    "LLMWrapperBase": "torchrl.modules.llm.LLMWrapperBase",
    "TensorDictBase": "tensordict.TensorDictBase",
    "tensordict.base.TensorDictBase": "tensordict.TensorDictBase",
    "torchrl.modules.llm.policies.common.LLMWrapperBase": "torchrl.modules.llm.LLMWrapperBase",
    "torchrl.objectives.llm.grpo.GRPOLoss": "torchrl.objectives.llm.GRPOLoss",
    "torchrl.objectives.llm.grpo.LLMLossOutput": "torchrl.objectives.llm.LLMLossOutput",
    "torchrl.envs.transforms._base.Transform": "torchrl.envs.transforms.Transform",
    "ProcessGroup": "torch.distributed.ProcessGroup",
    "torch.distributed.distributed_c10d.ProcessGroup": "torch.distributed.ProcessGroup",
    "torch.optim.optimizer.Optimizer": "torch.optim.Optimizer",
    "torchrl.trainers.trainers.OptimizationStepper": "torchrl.trainers.OptimizationStepper",
    "torchrl.trainers.trainers.TrainerHookBase": "torchrl.trainers.TrainerHookBase",
    "Trainer": "torchrl.trainers.Trainer",
    "nn.Module": "torch.nn.Module",
    "torch.nn.modules.module.Module": "torch.nn.Module",
}


def _public_bases(app, name, obj, options, bases) -> None:
    for i, base in enumerate(bases):
        path = f"{base.__module__}.{base.__qualname__}"
        if path in _PUBLIC_PATHS:
            bases[i] = f":py:class:`{_PUBLIC_PATHS[path]}`"


def _resolve_public_path(app, env, node, contnode):
    target = node.get("reftarget")
    if node.get("refdomain") != "py" or target not in _PUBLIC_PATHS:
        return None
    node = node.deepcopy()
    node["reftarget"] = _PUBLIC_PATHS[target]
    return intersphinx.missing_reference(app, env, node, contnode)


# -- Class signatures --------------------------------------------------------------
# autodoc takes a class' signature from a user-defined ``__new__`` before
# ``__init__``; TorchRL's LossModule defines ``__new__(cls, *args, **kwargs)``,
# which would hide the losses' arguments. Show ``__init__``'s instead. The loss
# outputs are tensorclasses built by the loss, with one constructor argument per
# field: their fields are documented in the class docstring, so they get none.


def _class_signature(app, what, name, obj, options, signature, return_annotation):
    if what != "class" or not isinstance(obj, type):
        return None
    if issubclass(obj, LLMLossOutput):
        return "", None
    if issubclass(obj, LossModule):
        init = obj.__init__
        update_defvalue(app, init, True)  # autodoc_preserve_defaults
        sig = sphinx_inspect.signature(
            init, bound_method=True, type_aliases=app.config.autodoc_type_aliases
        )
        return sphinx_inspect.stringify_signature(
            sig, show_return_annotation=False, unqualified_typehints=True
        ), None
    return None


# -- Members -------------------------------------------------------------------
# Document what this package defines. The loss outputs are tensorclasses, which
# carry every TensorDict method: those are tensordict's to document.


def _skip_foreign_member(app, what, name, obj, skip, options):
    target = getattr(obj, "fget", obj)
    module = getattr(target, "__module__", None) or ""
    if what == "class" and not module.startswith("torchrl_gspo"):
        return True
    return None


def setup(app):
    app.connect("include-read", _rebase_included_markdown)
    app.connect("autodoc-skip-member", _skip_foreign_member)
    app.connect("autodoc-process-bases", _public_bases)
    app.connect("autodoc-process-signature", _class_signature)
    app.connect("missing-reference", _resolve_public_path)
