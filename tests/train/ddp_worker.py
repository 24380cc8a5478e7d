"""One process of a test run launched by torchrun (tests/train/test_ddp.py), or of its one-process twin.

    python -m torch.distributed.run --nproc_per_node 2 tests/train/ddp_worker.py run CONFIG.json [--crash-after N]
    python -m torch.distributed.run --nproc_per_node 2 tests/train/ddp_worker.py grads OUT.pt

``run`` trains the tiny Llama (``--load``: the config's ``model.name_or_path``) on the in-memory token data with
the JSON config; ``--crash-after N`` raises after
step N on every rank, or on ``--crash-rank`` alone (the process "dies" there, exit status 3); ``--kill-after N``
has the process SIGKILL itself in the middle of step N + 1's forward instead (inside the second decoder layer),
as when the machine kills it. ``grads`` runs one accumulation window through
the DDP engine with deliberately unequal token counts per rank and saves the reduced LoRA gradients (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))  # runner_helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tiny_models

import torch
from runner_helpers import collate, token_dataset
from torch.distributed.tensor import DTensor

from loralei import LoRAConfig, inject_lora
from loralei.train import distributed, launch
from loralei.train.loop import LoopSettings, _forward_backward
from loralei.train.losses import cross_entropy_loss
from loralei.train.run import train
from loralei.train.schema import validate_config
from loralei.train.state import Trainables
from tiny_models import tiny_model

EXIT_CRASHED = 3


class Crash(Exception):
    """Stands for the process being killed."""


def unequal_window(rank: int) -> list[dict[str, torch.Tensor]]:
    """Rank 0: one short row (few trainable tokens); rank 1: three long rows. The whole window is both."""
    rows = token_dataset(8)
    mine = [rows[0]] if rank == 0 else rows[1:4]
    return [collate(mine)]


def lora_model() -> torch.nn.Module:
    return inject_lora(tiny_model("llama"), LoRAConfig(r=4, lora_alpha=8, init_lora_weights=False))


def _prefetch(model: torch.nn.Module) -> dict[str, list[str]]:
    """Each FSDP2 unit's name and the names of the units whose gathers its forward starts."""
    names = {module: name for name, module in model.named_modules()}
    chains = {}
    for module, name in names.items():
        state = getattr(module, "_get_fsdp_state", None)
        if state is not None:
            chains[name] = [names[m] for s in state()._states_to_forward_prefetch for m in s._modules]
    return chains


def grads(out: Path, mode: str) -> None:
    """One window through the DDP or FSDP2 engine (rank 0 writes the reduced gradients). Under FSDP2 the
    gradients are summed in buckets of 100 elements, so that the tiny model's factors span several."""
    run_launch = launch.read_launch(mode)
    device = launch.start(run_launch)
    launch._BUCKET_ELEMENTS = 100
    model = lora_model().to(device)
    engine = launch.wrap(model, cross_entropy_loss, run_launch, device)
    objs = Trainables(model, optimizer=None, scheduler=None, engine=engine)
    _forward_backward(
        objs,
        unequal_window(distributed.rank()),
        cross_entropy_loss,
        LoopSettings(1, 2, None, 1, None, None, 3, device),
    )
    if distributed.is_main_process():
        hook = engine._get_ddp_logging_data().get("comm_hook", "") if mode == "ddp" else "reduce_gradients"
        sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        torch.save({"grads": grads, "hook": hook, "sharded": sharded, "prefetch": _prefetch(model)}, out)
    del engine, objs  # the reducer holds the process group: gone before the group ends
    launch.stop()


def _kill_self(*_args) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def run(
    config: Path, crash_after: int | None, crash_rank: int | None, kill_after: int | None, load: bool = False
) -> None:
    cfg = validate_config(json.loads(config.read_text()))
    model = None if load else tiny_model("llama")

    def crash(state) -> None:
        if crash_rank not in (None, distributed.rank()):
            return
        if state.global_step == crash_after:
            raise Crash
        if state.global_step == kill_after:  # dies mid-step: the other ranks are inside the same step
            model.model.layers[1].register_forward_pre_hook(_kill_self)

    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=0) if load else None  # token data: ids only
    try:
        train(
            cfg,
            model=model,
            tokenizer=tokenizer,
            dataset=token_dataset(),
            collate_fn=collate,
            callbacks=[crash],
        )
    except Crash:
        launch.exit_failed(EXIT_CRASHED)
        sys.exit(EXIT_CRASHED)


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    run_cmd = sub.add_parser("run")
    run_cmd.add_argument("config", type=Path)
    run_cmd.add_argument("--crash-after", type=int, default=None)
    run_cmd.add_argument("--kill-after", type=int, default=None)
    run_cmd.add_argument("--crash-rank", type=int, default=None, help="crash this rank only (default: all)")
    run_cmd.add_argument(
        "--load", action="store_true", help="the runner loads model.name_or_path (default: the tiny Llama)"
    )
    grads_cmd = sub.add_parser("grads")
    grads_cmd.add_argument("out", type=Path)
    grads_cmd.add_argument("--mode", default="ddp", choices=["ddp", "fsdp2"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.command == "grads":
        grads(args.out, args.mode)
    else:
        run(args.config, args.crash_after, args.crash_rank, args.kill_after, args.load)


if __name__ == "__main__":
    main()
