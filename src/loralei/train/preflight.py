"""Checks of a run config that need neither torch nor the data: local paths that do not exist, and what the run
would do with its output directory. ``loralei-finetune`` runs them before loading anything, so that these
mistakes are all reported in a second, together."""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError, LoraleiError, together
from ..hub import missing_local_path
from .output_dir import plan_output_dir
from .preference.checks import check_reference_path
from .schema import RunConfig


def _template_path(template: str | None) -> str | None:
    """``data.chat_template`` when it names a file rather than holding a Jinja template."""
    return template if template and "{" not in template and "\n" not in template else None


def _path_problems(cfg: RunConfig) -> list[str]:
    names = [
        ("model.name_or_path", cfg.model.name_or_path, False),
        ("model.tokenizer", cfg.model.tokenizer, False),
        ("data.path", cfg.data.path, True),
        ("data.eval_path", cfg.data.eval_path, True),
    ]
    problems = [missing_local_path(field, name, data) for field, name, data in names if name]
    if (template := _template_path(cfg.data.chat_template)) and not Path(template).expanduser().is_file():
        problems.append(
            f"data.chat_template: {template!r} is neither a Jinja template nor an existing file; give the "
            "template itself or the path of a .jinja file"
        )
    if cfg.preference is not None and cfg.training.objective in ("dpo", "kto"):
        problems.append(check_reference_path(cfg.preference.reference))
    return [problem for problem in problems if problem]


def preflight(cfg: RunConfig) -> None:
    """Checks the local paths of ``cfg`` and plans its output directory (read-only).

    Raises:
        LoraleiError: every problem found (a ``ConfigError`` listing them when there are several).
    """
    problems: list[LoraleiError] = [ConfigError(problem) for problem in _path_problems(cfg)]
    try:
        plan_output_dir(cfg)
    except LoraleiError as exc:
        problems.append(exc)
    if problems:
        raise together(problems)
