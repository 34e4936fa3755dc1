"""Where a chat template comes from: a name of one shipped with pytrain, or a Jinja file.

Why names: some GGUFs carry no chat template (Gemma 3's from llama.cpp's converter), and a
path into pytrain's source tree works only from a checkout's root, never from a pip install.
``--chat-template gemma`` and ``data.chat_template = "gemma"`` work from anywhere.
"""
from __future__ import annotations

from pathlib import Path

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "assets" / "chat_templates"


def builtin_names() -> list[str]:
    """The names of the chat templates shipped with pytrain (``gemma``: Gemma's turn format,
    as llama.cpp's built-in ``gemma`` template renders it)."""
    return sorted(p.stem for p in TEMPLATE_DIR.glob("*.jinja"))


def is_builtin_name(value: str) -> bool:
    return value in builtin_names()


def read_template(value: str, option: str) -> tuple[str, str]:
    """(text, source) of the template ``value`` names: a built-in name, else a file path.
    ``option`` (``--chat-template``, ``data.chat_template``) starts an error's message."""
    from pytrain.data.chat_template import ChatTemplateError     # jinja2: only when reading
    path = Path(value).expanduser()
    if is_builtin_name(value) and not path.is_file():
        path = TEMPLATE_DIR / f"{value}.jinja"
    try:
        return path.read_text(encoding="utf-8"), str(path)
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or e
        raise ChatTemplateError(f"{option}: cannot read {value}: {why} (built-in templates: "
                                f"{', '.join(builtin_names())}; or a Jinja file)") from None


def no_template_hint(option: str) -> str:
    """What to do about a model without a chat template, for its error message."""
    return (f"set {option} to a built-in template ({', '.join(builtin_names())}) or a Jinja "
            f"file")
