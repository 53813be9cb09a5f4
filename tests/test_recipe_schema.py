"""The recipe schema stays small and every key in it is read: a key nothing reads is a knob that does nothing."""

from __future__ import annotations

import re
import typing

from pydantic import BaseModel
from test_packaging import product_modules

from polyspec.config import Recipe

MOST_KEYS = 75  # docs/ARCHITECTURE.md, "A new recipe key": a finding becomes an option only with its reason


def leaf_keys(cls: type[BaseModel] = Recipe, prefix: str = "") -> list[str]:
    """Every leaf key of the schema, dotted (sections and nested specs walked; lists and dicts are leaves)."""
    out = []
    for name, field in cls.model_fields.items():
        ann = field.annotation
        sub = [a for a in (ann, *typing.get_args(ann)) if isinstance(a, type) and issubclass(a, BaseModel)]
        out += leaf_keys(sub[0], f"{prefix}{name}.") if sub else [prefix + name]
    return out


def test_the_schema_has_at_most_75_leaf_keys():
    keys = leaf_keys()
    assert len(keys) == len(set(keys)) and len(keys) <= MOST_KEYS, (len(keys), keys)


def unread_keys(keys: list[str], code: str) -> list[str]:
    """The keys whose name ``code`` never reads as an attribute (``.lr``)."""
    return [k for k in keys if not re.search(rf"\.{re.escape(k.rsplit('.', 1)[-1])}\b", code)]


def test_every_leaf_key_is_read_by_the_product():
    """Each key's name is read as an attribute somewhere in the installed code other than the schema's own modules."""
    schema = {"polyspec.config", "polyspec.chain_spec"}
    code = "\n".join(path.read_text(encoding="utf-8") for name, path in product_modules().items()
                     if name not in schema)
    assert not unread_keys(leaf_keys(), code)


def test_the_read_check_reports_an_unread_key():
    assert unread_keys(["train.lr", "train.lr_decay", "data.seed"], "cfg.lr * 2\nx = cfg.seeds") == \
        ["train.lr_decay", "data.seed"]
