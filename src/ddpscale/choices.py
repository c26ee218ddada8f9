"""Which option of each config group a command line composes, and the keys each option has.

For `optim.beta1=0.8` without `optim=adamw`, Hydra answers "To append to your config use
+optim.beta1=0.8", which ddpscale then refuses: the key is one of adamw's, and the fix is
`optim=adamw`. Telling that apart needs the option the run composes, from the command line,
conf/config.yaml's defaults or an experiment's; Hydra's own defaults list gives it without
composing the config. Where it cannot (another config directory, a plug-in's option whose
schema is not registered yet), the override is left to Hydra.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore

# The conf/ beside train.py in a checkout; elsewhere (an installed package) none, and Hydra answers
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
_CHOSEN_HERE = "the {group} chosen here"
_MOST_COMBINATIONS = 32  # of swept group choices; a bigger grid is left to Hydra


def keys_of_other_options(parsed: list[Any], suspects: list[Any], conf_dir: Path | None) -> list[str]:
    """One message per `group.key=value` override in `suspects` (a key some option of the
    group has, but not all) whose key no option this command line chooses has; `parsed` is
    the whole command line, as Hydra's override parser reads it."""
    if not suspects:  # the usual command line: no defaults list to compute
        return []
    combinations = _defaults_combinations(parsed)
    if conf_dir is None or not conf_dir.is_dir() or combinations is None:
        return []
    try:
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from hydra._internal.utils import create_config_search_path

        loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(conf_dir)))
        chosen = [_options_and_keys(loader, combination) for combination in combinations]
    except Exception:  # noqa: BLE001  a config Hydra cannot find or read: it says so itself
        return []
    problems = []
    for override in suspects:
        group, key = override.key_or_group.split(".")[:2]
        options = {choice[group][0]: choice[group][1] for choice in chosen if group in choice}
        lacking = [option for option, keys in options.items() if keys is not None and key not in keys]
        if not lacking:
            continue
        having = options_with_key(group, key)
        problems.append(_message(override, group, key, lacking, [o for o in options if o not in lacking],
                                 having, _chosen_how(parsed, group)))
    return problems


def _message(override: Any, group: str, key: str, lacking: list[str], swept_having: list[str],
             having: list[str], how: str) -> str:
    line = override.input_line
    owners = " or ".join(f"{group}={option}" for option in having) or f"another {group} option"
    not_of = ", ".join(f"{group}={option}" for option in lacking)
    if swept_having:  # a sweep over options, some of which have the key
        return (f"{group}.{key} is a key of {owners}, not of {not_of} (swept here), and Hydra gives an "
                f"override to every job of a sweep, so it cannot compose the {not_of} jobs; sweep "
                f"{', '.join(f'{group}={o}' for o in swept_having)} with {line} in one command and "
                f"{not_of} without it in another, or drop {line}")
    add = " or ".join(f"{group}={option}" for option in having) or f"a {group} option that has it"
    add = f"choose {add} in place of {not_of}" if how == _CHOSEN_HERE.format(group=group) else f"add {add}"
    return f"{group}.{key} is a key of {owners}, not of {not_of} ({how}); {add}, or drop {line}"


def _chosen_how(parsed: list[Any], group: str) -> str:
    """How this command line chose the group's option, said in a message."""
    if any(o.key_or_group == group for o in parsed):
        return _CHOSEN_HERE.format(group=group)
    if any("." not in o.key_or_group and o.key_or_group != group for o in parsed if o.is_add()):
        return f"the {group} this command line composes, by default or by what it adds"
    return f"the default {group}, from conf/config.yaml"


def _defaults_combinations(parsed: list[Any]) -> list[list[str]] | None:
    """The overrides that shape Hydra's defaults list (group choices, +experiment=..., the
    search path), one list per combination of the swept ones; None when they cannot be
    enumerated here."""
    from hydra.core.override_parser.types import OverrideType

    fixed, swept = [], []
    for override in parsed:
        group = override.key_or_group
        if group != "hydra.searchpath" and ("." in group or group.startswith("hydra")):
            continue
        if not override.is_sweep_override():
            fixed.append(override.input_line)
        elif override.type == OverrideType.CHANGE and override.package is None and override.is_discrete_sweep():
            try:
                swept.append([f"{group}={value}" for value in override.sweep_string_iterator()])
            except Exception:  # noqa: BLE001  a glob needs the options Hydra lists
                return None
        else:
            return None
    combinations = [fixed + list(choice) for choice in itertools.product(*swept)]
    return combinations if len(combinations) <= _MOST_COMBINATIONS else None


def _options_and_keys(loader: Any, overrides: list[str]) -> dict[str, tuple[str, set[str] | None]]:
    """{group: (the option chosen, the keys of its schema, or None when it has none registered)}."""
    from hydra.types import RunMode

    defaults = loader.compute_defaults_list("config", overrides, RunMode.RUN)
    chosen = {}
    for group, option in defaults.overrides.known_choices.items():
        if option is None or "/" in group:
            continue
        schemas = [d.config_path for d in defaults.defaults
                   if d.parent == f"{group}/{option}" and d.config_path.startswith("schema/")]
        keys = set().union(*(ConfigStore.instance().load(f"{s}.yaml").node.keys() for s in schemas)) or None
        chosen[group] = (option, keys)
    return chosen


def options_with_key(group: str, key: str) -> list[str]:
    """The options of `group` whose schema (schema/<group>/<option>, README: Extending) has `key`."""
    cs = ConfigStore.instance()
    if group not in cs.list("schema"):
        return []
    options = [name.removesuffix(".yaml") for name in cs.list(f"schema/{group}")]
    return [o for o in options if o != group and key in cs.load(f"schema/{group}/{o}.yaml").node]
