"""Hugging Face ``Trainer`` with Muon: ``optimizers=(muonfn.optim.Muon(...), scheduler)``.

A tiny GPT-2, randomly initialised (nothing is downloaded), learns a character stream made of
the Python standard library's source. GPT-2 stores its projections as ``Conv1D`` weights of
shape ``(in, out)``: ``muonfn.views_from_module`` declares them transposed (the fused
``c_attn`` is also split into its q, k and v blocks), and
``muonfn.labels_from_module`` routes them to Muon while the token and position embeddings
(and the head tied to them) go to AdamW.

    pip install -e ".[hf]"
    python examples/hf_trainer.py [--steps 60]
"""

from __future__ import annotations

import argparse
import pathlib
import sysconfig
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, get_cosine_schedule_with_warmup

import muonfn
import muonfn.optim

CONTEXT = 64


class CharStream(torch.utils.data.Dataset):
    """Windows of byte-level tokens from the standard library's source."""

    def __init__(self, chars: int = 400_000, windows: int = 4096) -> None:
        root = pathlib.Path(sysconfig.get_paths()["stdlib"])
        text = b"".join(p.read_bytes() for p in sorted(root.glob("*.py"))[:40])[:chars]
        self.data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        self.starts = torch.randint(0, len(self.data) - CONTEXT, (windows,), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.data[self.starts[i] : self.starts[i] + CONTEXT]
        return {"input_ids": window, "labels": window}  # the model shifts the labels itself


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    # one rate for both groups, sized as AdamW's would be: the default scale gives Muon's update AdamW's RMS
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--out", help="Trainer output folder (default: a temporary one)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
    )
    model = GPT2LMHeadModel(config)
    labels = muonfn.labels_from_module(model)  # the head tied to the token embedding appears once
    print("Muon matrices:", sorted(name for name, label in labels.items() if label == "muon"))
    views = muonfn.views_from_module(model)  # every Conv1D weight: MatrixView(transposed=True)
    for i in range(config.n_layer):  # c_attn fuses q, k and v: orthogonalize each on its own
        views[f"transformer.h.{i}.attn.c_attn.weight"] = muonfn.MatrixView(transposed=True, split=(config.n_embd,) * 3)

    optimizer = muonfn.optim.Muon(
        model.named_parameters(),
        lr=args.lr,
        weight_decay=0.01,
        labels=labels,
        views=views,
    )
    warmup = args.steps // 10
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=warmup, num_training_steps=args.steps)

    with tempfile.TemporaryDirectory() as scratch:
        training_args = TrainingArguments(
            output_dir=args.out or scratch,
            max_steps=args.steps,
            per_device_train_batch_size=16,
            logging_steps=max(1, args.steps // 5),
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=model, args=training_args, train_dataset=CharStream(), optimizers=(optimizer, scheduler)
        )
        result = trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"train_loss {result.training_loss:.4f}; logged losses {' '.join(f'{v:.3f}' for v in losses)}")
    if not losses[-1] < losses[0]:
        raise SystemExit("training did not reduce the loss")
    return {"train_loss": result.training_loss}


if __name__ == "__main__":
    main()
