"""From command-line overrides to a checked, frozen Config, with one-line errors.

Hydra reports composition errors over several lines and accepts `+unknown=1` silently. So before
Hydra's own entry point runs, every override (every point of a `-m` sweep) is composed here, turned
into the frozen Config and checked; the first problem becomes one sentence and exit code 2, and
nothing is launched or written.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from common.errors import ConfigError
from pipelines.configtools import from_dict
from pipelines.dag import build
from pipelines.paths import CONF_DIR
from pipelines.schema import Config, register
from pipelines.validate import resolve

INFO_FLAGS = {"--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--shell-completion", "-sc", "--resolve"}
FLAGS_WITH_VALUE = {"--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd", "--package", "-p",
                    "--experimental-rerun"}


class UserError(Exception):
    """A bad invocation: print the message alone and exit 2."""


def load(data: dict[str, Any]) -> Config:
    """The frozen, resolved Config from a composed plain dict; ConfigError on any problem."""
    data = {k: v for k, v in data.items() if k != "hydra"}
    cfg = from_dict(Config, data)
    dag = build(cfg.pipeline)
    return resolve(cfg, uses_model=dag.uses("model"))


CONFIG_DIR_FLAGS = ("--config-dir", "-cd")


def split_argv(argv: list[str]) -> tuple[list[str], bool, bool]:
    """(overrides, multirun, info_only) from Hydra's command line. A user's `--config-dir` (their
    own YAMLs, e.g. conf/model/my_vit.yaml) becomes the search-path override Hydra gives it."""
    overrides, multirun, info = [], False, False
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        flag, _, value = arg.partition("=")
        if flag in CONFIG_DIR_FLAGS:
            value = value or (argv[i + 1] if i + 1 < len(argv) else "")
            skip = "=" not in arg
            overrides.append(f"hydra.searchpath=[file://{Path(value).resolve()}]")
        elif arg in ("-m", "--multirun"):
            multirun = True
        elif arg in INFO_FLAGS or flag in INFO_FLAGS:
            info = True
            skip = arg in ("--cfg", "-c")
        elif arg in FLAGS_WITH_VALUE:
            skip = True
        elif not arg.startswith("-"):
            overrides.append(arg)
    return overrides, multirun, info


def sweep_points(overrides: list[str]) -> list[list[str]]:
    """Every combination of a `-m` sweep, as lists of plain overrides."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = []
    for o in parsed:
        if o.is_sweep_override():
            choices.append([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()])
        else:
            choices.append([o.input_line])
    return [list(point) for point in itertools.product(*choices)]


def precheck(argv: list[str]) -> None:
    """Compose and check the invocation (each sweep point); raise UserError with one sentence."""
    overrides, multirun, info = split_argv(argv)
    if info:
        return
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    register()
    try:
        points = sweep_points(overrides) if multirun else [overrides]
    except Exception as err:  # noqa: BLE001 - Hydra's parser errors are user errors
        raise UserError(one_line(err)) from None
    output_dir(overrides, multirun)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for point in points:
            own = [o for o in point if not re.match(r"^[+~]*hydra[./]", o) or o.startswith("hydra.searchpath=")]
            try:
                composed = compose(config_name="config", overrides=own)
                cfg = load(OmegaConf.to_container(composed, resolve=True))
                if cfg.pipeline.precheck:  # e.g. an unknown study: one line before Hydra writes
                    from common.functions import import_function

                    import_function(cfg.pipeline.precheck)(cfg)
            except ConfigError as err:
                raise UserError(str(err)) from None
            except Exception as err:  # noqa: BLE001 - composition errors are user errors
                foreign_option(own)
                raise UserError(one_line(err)) from None


def foreign_option(overrides: list[str]) -> None:
    """Hydra refuses `launcher.partition=gpu` under launcher=local as a key not in the config;
    say instead which option of the group has it (the group's schemas, configtools.Tagged)."""
    from pipelines.configtools import Tagged, tagged_schema

    groups = {f.name: f.default_factory for f in dataclasses.fields(Config)
              if isinstance(f.default_factory, type) and issubclass(f.default_factory, Tagged)}
    chosen = {o.split("=", 1)[0]: o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] in groups}
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        group, _, leaf = key.partition(".")
        if group in groups and leaf and "." not in leaf:
            try:
                tagged_schema(groups[group], {"name": chosen.get(group, groups[group]().name), leaf: value}, group)
            except ConfigError as err:
                raise UserError(str(err)) from None


DEFAULT_DIRS = {"hydra.run.dir": "outputs/runs", "hydra.sweep.dir": "outputs/multirun"}
"""conf/config.yaml's run and sweep directories, up to their first interpolated part."""


def output_dir(overrides: list[str], multirun: bool) -> None:
    """The directory Hydra will create for this invocation can be created: else one line naming
    the key, before Hydra tries (its failure is a traceback) and before anything is written."""
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    given = next((o.split("=", 1)[1] for o in reversed(overrides) if o.split("=", 1)[0].lstrip("+") == key), None)
    value = given if given is not None else DEFAULT_DIRS[key]
    path = Path(value.split("${", 1)[0] or ".").expanduser()
    probe = path if path.is_absolute() else Path.cwd() / path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"{key}={value}: cannot be created: {probe} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"{key}={value}: cannot be created: {probe} is not writable")
    # Permission bits don't tell everything (root passes os.access; /proc and read-only mounts
    # refuse anyway): make a directory there and remove it again.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".scalestudy-check-", dir=probe))
    except OSError as err:
        raise UserError(f"{key}={value}: cannot be created: {probe} refuses a new directory "
                        f"({err.strerror or err})") from None


def one_line(err: BaseException) -> str:
    """Hydra's and OmegaConf's multi-line errors as one sentence naming the key and the value."""
    from hydra.errors import MissingConfigException

    if isinstance(err, MissingConfigException) and err.options:
        group, _, option = (err.missing_cfg_file or "").partition("/")
        return f"{group}={option}: no such option; available: {', '.join(sorted(err.options))}"
    cause = err.__cause__ or err
    full_key = getattr(cause, "full_key", None)
    lines = [ln.strip() for ln in str(cause).splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(("full_key:", "object_type=", "reference_type="))]
    message = lines[0] if lines else type(cause).__name__
    if "not in struct" in message or "is not in" in message:
        message = "unknown key; see `python run.py --cfg job` for the valid keys"
    match = re.search(r"Error merging override (\S+)", str(err))
    if full_key and match:
        return f"{match.group(1)}: {message}"
    if full_key:
        return f"{full_key}: {message}"
    return " ".join(lines) if lines else message


def write_run_config(run_dir: Path, cfg: Any, overrides: list[str]) -> Path:
    """`<run dir>/config.yaml`: the resolved config and the command line's overrides, secrets
    masked. It stands in for Hydra's `.hydra/` files (disabled: they hold everything in clear)."""
    from omegaconf import OmegaConf

    from common.files import write_atomic
    from pipelines.configtools import to_jsonable
    from pipelines.redact import redact_override, redact_tree

    path = run_dir / "config.yaml"
    run_dir.mkdir(parents=True, exist_ok=True)
    data = {"overrides": [redact_override(o) for o in overrides], "config": redact_tree(to_jsonable(cfg))}
    write_atomic(path, OmegaConf.to_yaml(OmegaConf.create(data)))
    return path
