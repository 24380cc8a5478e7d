"""One rank of a sequence-parallel step (tests/train/test_sequence_parallel.py), launched by torchrun:

    python -m torch.distributed.run --nproc_per_node N tests/train/sequence_parallel_worker.py \
        OUT.pt HEADS KV DIM LOSS FUSED PACKED

Every rank builds the same tiny Llama (hidden 48, ``HEADS`` query heads of ``DIM`` dims, ``KV`` key/value heads)
with LoRA, takes its shard of the test batch (:func:`batch`), computes its share of the ``LOSS`` loss
(``cross_entropy`` or ``linear_cross_entropy``) over the batch's trainable tokens counted on every rank, runs the
backward and sums the LoRA gradients over the ranks. ``FUSED`` = 1 runs loralei's fused kernels, ``PACKED`` = 1
packs documents into the rows (:func:`batch`). Rank 0 saves the summed loss and gradients to ``OUT.pt``. With a
GPU for every rank the ranks run there and talk through NCCL; otherwise on the CPU through gloo.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tiny_models

import torch
import torch.distributed as dist

from loralei import LoRAConfig, apply_fused_kernels, inject_lora
from loralei.train import sequence_parallel
from loralei.train.data.collate import block_causal_mask
from loralei.train.losses import build_loss, count_trainable_tokens, trainable_labels
from tiny_models import tiny_model


def lora_model(heads: int, kv_heads: int, fused: bool, head_dim: int = 8) -> torch.nn.Module:
    # hidden 48: Llama's config wants it a multiple of the head count (2, 3, 4 and 6 here)
    model = tiny_model(
        "llama", hidden_size=48, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim
    )
    inject_lora(model, LoRAConfig(r=4, lora_alpha=8, init_lora_weights=False))
    if fused:
        apply_fused_kernels(model)
    return model


def batch(packed: bool = False) -> dict[str, torch.Tensor]:
    """Two rows of 23 tokens (odd: the shards pad), the second padded on the right after 17, some labels masked.

    ``packed``: the rows hold documents of 9 + 14 and 5 + 12 tokens (over two ranks the first row's second
    document spans both), each document's first token untrained, as the packing collator lays them out (the
    padding a document of its own); the mask a one-process run attends with is their block-diagonal causal one.
    """
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 128, (2, 23), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :5] = -100  # a prompt
    if not packed:
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    documents = [(9, 14), (5, 12, 6)]
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in documents])
    labels = labels.masked_fill(positions == 0, -100)
    return {
        "input_ids": ids,
        "position_ids": positions,
        "attention_mask": block_causal_mask(positions),
        "labels": labels,
    }


def lora_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def rank_device() -> torch.device:
    """This rank's GPU where every rank on the machine has one (the ranks then talk through NCCL), else the CPU."""
    local, ranks = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if torch.cuda.device_count() < ranks:
        return torch.device("cpu")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def main(
    out: str, heads: int, kv_heads: int, head_dim: int, loss_name: str, fused: bool, packed: bool
) -> None:
    device = rank_device()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    group = sequence_parallel.new_group(dist.get_world_size())
    model = lora_model(heads, kv_heads, fused, head_dim).to(device)
    sequence_parallel.enable(model, group, packed=packed)
    shard = sequence_parallel.shard_batch(batch(packed), dist.get_rank(group), dist.get_world_size(group))
    shard = {key: value.to(device) for key, value in shard.items()}
    count = torch.tensor(float(count_trainable_tokens(shard)), device=device)
    dist.all_reduce(count)
    loss = build_loss(loss_name, liger=False)(model, shard, trainable_labels(shard), count)
    loss.backward()
    grads = lora_grads(model)
    for g in grads.values():
        dist.all_reduce(g)
    total = loss.detach().clone()
    dist.all_reduce(total)
    if dist.get_rank() == 0:
        torch.save({"loss": total.cpu(), "grads": {name: g.cpu() for name, g in grads.items()}}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    heads, kv_heads, head_dim = (int(a) for a in sys.argv[2:5])
    main(sys.argv[1], heads, kv_heads, head_dim, sys.argv[5], sys.argv[6] == "1", sys.argv[7] == "1")
