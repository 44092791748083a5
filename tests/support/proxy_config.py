"""A ProxyConfig from its fields by name, for tests: each field goes to the section that holds
it (`serving`, `media`, `planning`, `views`, `store`), so a test names only what it sets."""

from __future__ import annotations

import dataclasses
from typing import Any

from mmreuse.proxy.config import (
    MediaConfig,
    PlanningConfig,
    ProxyConfig,
    ServingConfig,
    StoreConfig,
    ViewsConfig,
)

SECTIONS = {
    "serving": ServingConfig,
    "media": MediaConfig,
    "planning": PlanningConfig,
    "views": ViewsConfig,
    "store": StoreConfig,
}
SECTION_OF = {f.name: name for name, kind in SECTIONS.items() for f in dataclasses.fields(kind)}


def config_of(**fields: Any) -> ProxyConfig:
    """`ProxyConfig(...)` with each section field given by its own name (`port=0`,
    `policy="index"`); the instance fields (URLs, instances, encoders) as they are."""
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    for key, value in fields.items():
        section = SECTION_OF.get(key)
        if section is None:
            top[key] = value
        else:
            sections.setdefault(section, {})[key] = value
    built = {name: SECTIONS[name](**values) for name, values in sections.items()}
    return ProxyConfig(**top, **built)


def seeded(config: ProxyConfig, seed: int) -> ProxyConfig:
    """`config` with its routing draws seeded (`planning.seed`)."""
    return dataclasses.replace(config, planning=dataclasses.replace(config.planning, seed=seed))
