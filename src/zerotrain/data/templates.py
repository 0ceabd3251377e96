"""Which chat template renders chat records for training: the user's file, a training variant of a known template, or
the model's own, and why.

A template is written for inference, and some do not serve training as they ship: Qwen3's drops the reasoning of
every assistant turn before the last user message, so an earlier turn reads differently once a later one exists (it
is not prefix-preserving), and where its turns are cannot be told by rendering growing prefixes. TRL keeps, for the
common families, each template as its model repository ships it (`trl/chat_templates/NAME.jinja`) beside a training
variant (`NAME_training.jinja`): prefix-preserving (Qwen3's keeps every turn's reasoning), with `{% generation %}`
markers around what the assistant writes. As TRL's own `get_training_chat_template` does, the variant is swapped in
when the model's template is the original, compared as text (line endings and the whitespace at its ends aside:
tokenizer_config.json and chat_template.jinja keep the same template with or without a final newline). The files are
read from TRL's installed package (the `chat` extra) without importing TRL: its variants follow the templates the
model repositories ship (TRL checks them weekly against the hub), which a copy kept here would not.

The order: --chat-template FILE; else the training variant of a known original; else the model's own (its markers,
or its turns found by growing prefixes, checked on every record: chat.py).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import re
from dataclasses import dataclass
from functools import lru_cache

from zerotrain.errors import ConfigError

TRAINING_SUFFIX = "_training.jinja"
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class TemplateChoice:
    """The chat template that trains, and where it comes from: "file" (--chat-template), "trl" (a training variant of
    the model's template from TRL's package) or "model" (the model folder's own)."""

    text: str
    origin: str
    name: str  # the file (origin "file"), TRL's name of the template ("qwen3"), or the model folder

    def describe(self, marked: bool) -> str:
        """What trains and why, for prepare's output and the start line."""
        if self.origin == "file":
            return f"the chat template of --chat-template {self.name}"
        if self.origin == "trl":
            return (f"the training variant of {self.name} from TRL {trl_version()} ({self.name}{TRAINING_SUFFIX}: the "
                    f"model's template is TRL's {self.name}.jinja)")
        how = "its generation markers" if marked else "its turns found by growing prefixes"
        return f"the model's own chat template ({how})"

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def normalized(template: str) -> str:
    """A template's text as it is compared with the known originals."""
    return template.replace("\r\n", "\n").strip()


def trl_folder() -> str | None:
    """TRL's chat_templates folder, found without importing TRL; None where TRL is not installed."""
    try:
        spec = importlib.util.find_spec("trl")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        folder = os.path.join(root, "chat_templates")
        if os.path.isdir(folder):
            return folder
    return None


def trl_version() -> str:
    try:
        return importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        return "(unknown version)"


@lru_cache(maxsize=4)
def _variants(folder: str) -> dict[str, str]:
    """{normalized original: its name} of every original in `folder` that has a training variant beside it."""
    known = {}
    for file in sorted(os.listdir(folder)):
        if not file.endswith(TRAINING_SUFFIX):
            continue
        name = file[: -len(TRAINING_SUFFIX)]
        original = os.path.join(folder, f"{name}.jinja")
        if os.path.isfile(original):
            with open(original, encoding="utf-8") as f:
                known.setdefault(normalized(f.read()), name)
    return known


def training_variant(template: str) -> tuple[str, str] | None:
    """(TRL's name of `template`, its training variant's text) where `template` is an original TRL keeps a training
    variant of; None otherwise, or where TRL is not installed."""
    folder = trl_folder()
    if folder is None:
        return None
    name = _variants(folder).get(normalized(template))
    if name is None:
        return None
    with open(os.path.join(folder, name + TRAINING_SUFFIX), encoding="utf-8") as f:
        return name, f.read()


def read_template_file(path: str) -> str:
    """The text of a --chat-template FILE; ConfigError naming it when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--chat-template {path}: cannot be read as a UTF-8 Jinja template "
                          f"({getattr(e, 'strerror', None) or e})") from None
    if not text.strip():
        raise ConfigError(f"--chat-template {path}: an empty file, not a chat template")
    return text


def choose_template(model_template: str | None, folder: str, template_file: str | None) -> TemplateChoice | None:
    """The template that renders chat records for training (the module's docstring says in which order); None where
    there is none (no --chat-template and a folder without a template)."""
    if template_file:
        return TemplateChoice(read_template_file(template_file), "file", template_file)
    if model_template is None:
        return None
    variant = None if GENERATION_TAG.search(model_template) else training_variant(model_template)
    if variant is not None:
        return TemplateChoice(variant[1], "trl", variant[0])
    return TemplateChoice(model_template, "model", folder)
