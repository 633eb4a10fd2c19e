"""The configuration reference, generated from the schema: every setting of every option's
schema with its type, default and documentation (the attribute docstrings of
``collage_train/config/schema.py``, read from its source).

``python -m collage_train.config.reference [GROUP ...]`` prints it as Markdown;
docs/config.md is its output for every group (tests/config/test_reference.py keeps it
current). ``python -m collage_train [OVERRIDES] --help`` shows the settings of the options
chosen there, with their values (``settings_help``, through the ``config_reference``
resolver in the help template of ``configs/config.yaml``).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import sys
import textwrap
import typing
from enum import Enum
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from collage_train.config import schema as config
from collage_train.config.options import option_schemas

GROUPS = ("model", "data", "precision", "optim", "train", "logging", "distributed", "comm")
GROUPS += ("metrics", "plan", "eval")


@functools.cache
def _own_docs(schema: type) -> dict[str, str]:
    """The attribute docstrings in ``schema``'s own class body: the string under a field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(schema)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for field, doc in itertools.pairwise(body):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)
        ):
            docs[field.target.id] = " ".join(inspect.cleandoc(doc.value.value).split())
    return docs


def field_docs(schema: type) -> dict[str, str]:
    """Each field's documentation, the most derived class's where a subclass redefines it."""
    docs: dict[str, str] = {}
    for cls in reversed(schema.__mro__):
        if dataclasses.is_dataclass(cls):
            docs.update(_own_docs(cls))
    return docs


def type_text(kind: Any) -> str:
    """A field's type as a reader writes a value: ``fp32|fp16``, ``int or null``, ..."""
    args = typing.get_args(kind)
    if type(None) in args:
        rest = [arg for arg in args if arg is not type(None)]
        return f"{type_text(rest[0])} or null"
    if typing.get_origin(kind) is list:
        return f"list of {type_text(args[0])}"
    if typing.get_origin(kind) is dict or kind is dict:
        return "mapping"
    if isinstance(kind, type) and issubclass(kind, Enum):
        return "|".join(str(member.value) for member in kind)
    return {int: "int", float: "float", str: "string", bool: "bool"}.get(kind, "any")


def default_text(item: dataclasses.Field) -> str:
    if item.default_factory is not dataclasses.MISSING:
        value = item.default_factory()
    else:
        value = item.default
    if value == MISSING:
        return "required"
    if dataclasses.is_dataclass(value):
        return "(below)"
    return _value_text(value)


def _value_text(value: Any) -> str:
    if isinstance(value, DictConfig) or dataclasses.is_dataclass(value):
        return "(below)"
    container = OmegaConf.to_container(OmegaConf.create({"v": value}), enum_to_str=True)["v"]
    if isinstance(container, str) and container != "":
        return container
    return OmegaConf.to_yaml({"v": container}).strip()[3:]


def _table(schema: type, prefix: str, names: list[str]) -> list[str]:
    hints = typing.get_type_hints(schema)
    docs = field_docs(schema)
    fields = {item.name: item for item in dataclasses.fields(schema)}
    rows = ["| Setting | Type | Default | What it does |", "| --- | --- | --- | --- |"]
    for name in names:
        kind = hints[name]
        shown = "settings" if dataclasses.is_dataclass(kind) else type_text(kind)
        cells = [f"`{prefix}{name}`", shown, default_text(fields[name]), docs.get(name, "")]
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return rows


def _nested(schema: type, prefix: str) -> list[str]:
    """Subsections for the settings groups a schema holds (``train.guard``)."""
    lines: list[str] = []
    hints = typing.get_type_hints(schema)
    for item in dataclasses.fields(schema):
        kind = hints[item.name]
        if dataclasses.is_dataclass(kind):
            path = f"{prefix}{item.name}"
            lines += ["", f"### {path}", "", _doc(kind), ""]
            lines += _table(kind, f"{path}.", [f.name for f in dataclasses.fields(kind)])
            lines += _nested(kind, f"{path}.")
    return lines


def _doc(schema: type) -> str:
    return " ".join(inspect.cleandoc(schema.__doc__ or "").split())


def group_section(group: str) -> list[str]:
    """The Markdown section of one group: a table per schema; a group with kinds of
    options lists what every option has, then what each kind adds or narrows."""
    lines = [f"## {group}", ""]
    if group not in config.SCHEMAS:
        schema = config.SINGLE_SCHEMAS[group]
        lines += [_doc(schema), ""]
        lines += _table(schema, f"{group}.", [f.name for f in dataclasses.fields(schema)])
        return lines + _nested(schema, f"{group}.")
    options = option_schemas(group)
    schemas = list(dict.fromkeys(options.values()))
    base = next(cls for cls in schemas[0].__mro__[::-1] if dataclasses.is_dataclass(cls))
    shared = [f.name for f in dataclasses.fields(base)]
    lines += [f"{_doc(base)} Every {group} option has these settings:", ""]
    lines += _table(base, f"{group}.", shared)
    for schema in schemas:
        chosen = "|".join(name for name, used in options.items() if used is schema)
        own = [
            f.name
            for f in dataclasses.fields(schema)
            if f.name not in shared or _redefined(schema, base, f.name)
        ]
        lines += ["", f"### {group}={chosen}", "", f"{_doc(schema)} (`{schema.__name__}`)", ""]
        lines += _table(schema, f"{group}.", own) if own else ["No settings of its own."]
    return lines


def _redefined(schema: type, base: type, name: str) -> bool:
    return typing.get_type_hints(schema)[name] != typing.get_type_hints(base)[name]


def reference(groups: tuple[str, ...] = GROUPS) -> str:
    """The Markdown reference of ``groups`` (docs/config.md holds it for every group)."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from the schema in `collage_train/config/schema.py` by "
        "`python -m collage_train.config.reference > docs/config.md`; do not edit it by hand "
        "(tests/config/test_reference.py checks that it is current). Pick an option of a "
        "group with `group=option` and set a setting with `group.key=value`, e.g. "
        "`python -m collage_train model=llama_tiny model.num_kv_heads=1`; a setting the "
        "chosen option does not have is refused in one `error:` line. "
        "`python -m collage_train --cfg job` prints the composed values.",
    ]
    for group in groups:
        lines += ["", *group_section(group)]
    return "\n".join(lines) + "\n"


def settings_help(root: DictConfig) -> str:
    """Every setting of the composed ``root`` with its value and documentation, group by
    group, as plain text for ``--help``."""
    lines: list[str] = []

    def walk(node: DictConfig, prefix: str) -> None:
        schema = OmegaConf.get_type(node)
        docs = field_docs(schema) if dataclasses.is_dataclass(schema) else {}
        for key in node:
            child = node._get_node(key)
            if isinstance(child, DictConfig) and dataclasses.is_dataclass(
                OmegaConf.get_type(child)
            ):
                walk(child, f"{prefix}{key}.")
                continue
            value = "???" if OmegaConf.is_missing(node, key) else _shown(child)
            lines.append(f"  {prefix}{key}={value}")
            doc = docs.get(str(key), "")
            lines.extend(textwrap.wrap(doc, 88, initial_indent=" " * 6, subsequent_indent=" " * 6))

    for group in GROUPS:
        if group in root:
            schema = OmegaConf.get_type(root[group])
            lines.append(f"{group} ({schema.__name__}): {_doc(schema)}")
            walk(root[group], f"{group}.")
            lines.append("")
    return "\n".join(lines).rstrip()


def _shown(node: Any) -> str:
    value = node._value() if hasattr(node, "_value") else node
    if isinstance(value, str) and value.startswith("${"):
        return value  # an interpolation, shown as written
    return _value_text(OmegaConf.to_container(node) if isinstance(node, DictConfig) else value)


def register_help_resolver() -> None:
    """``${config_reference:}`` in the help template: ``settings_help`` of the config, its
    ``$`` doubled (Hydra fills the template's ``$CONFIG``-style fields with string.Template)."""

    def resolve(*, _root_: DictConfig) -> str:
        return settings_help(_root_).replace("$", "$$")

    if not OmegaConf.has_resolver("config_reference"):
        OmegaConf.register_new_resolver("config_reference", resolve, use_cache=False)


def main(argv: list[str] | None = None) -> int:
    groups = tuple(sys.argv[1:] if argv is None else argv) or GROUPS
    unknown = [group for group in groups if group not in GROUPS]
    if unknown:
        print(
            f"error: no config group {unknown[0]!r}; choose among {', '.join(GROUPS)}",
            file=sys.stderr,
        )
        return 2
    sys.stdout.write(reference(groups))
    return 0


if __name__ == "__main__":
    sys.exit(main())
