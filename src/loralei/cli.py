"""``loralei-finetune``: run or validate a fine-tuning job described by a YAML file.

Usage::

    loralei-finetune config.yaml [dotted.key=value ...]
    loralei-finetune validate config.yaml [dotted.key=value ...]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .errors import LoraleiError

_EPILOG = """examples:
  loralei-finetune examples/quickstart.yaml
  loralei-finetune examples/quickstart.yaml training.max_steps=50 optimizer.lr=5e-3
  loralei-finetune validate examples/quickstart.yaml
overrides are dotted keys with YAML values: lora.target_modules=[q_proj,v_proj] wandb.project=demo"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loralei-finetune",
        description="LoRA fine-tuning of a Hugging Face causal LM from one YAML file.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("args", nargs="+", metavar="[validate] CONFIG [KEY=VALUE ...]")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``loralei-finetune``.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 on success, 2 for a bad config or input, 1 when training fails.
    """
    parser = _parser()
    args = list(parser.parse_args(argv).args)
    command = "validate" if args[0] == "validate" else "train"
    if command == "validate":
        args = args[1:]
    if not args:
        parser.error("the config file is missing: loralei-finetune validate CONFIG")
    config_path, overrides = args[0], args[1:]
    # `loralei.train` loads only the config side: `--help` and config errors answer without torch/transformers.
    from .errors import TrainingError
    from .train import load_config, train, validate

    try:
        cfg = load_config(config_path, overrides)
        if command == "validate":
            print(validate(cfg))
        elif (result := train(cfg)) is not None:  # None on processes other than the main one
            print(result.summary())
    except TrainingError as exc:
        print(f"loralei-finetune: training stopped: {exc}", file=sys.stderr)
        return _failed(1)
    except LoraleiError as exc:
        print(f"loralei-finetune: {exc}", file=sys.stderr)
        return _failed(2)
    return 0


def _failed(status: int) -> int:
    """``status``; a rank of a multi-process run exits with it at once (see ``launch.exit_failed``)."""
    from .train import exit_failed

    exit_failed(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
