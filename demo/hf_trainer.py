"""Hugging Face Trainer on zero_ext (README "Using with Hugging Face"): a GPT-2 of 2 layers learns random tokens.

    python -m zero_ext.launcher --num_procs 2 demo/hf_trainer.py --deepspeed demo/ds_zero3_auto.json \
        --output_dir /tmp/hf_out --max_steps 8 --per_device_train_batch_size 2 --logging_steps 1

Any TrainingArguments flag works (--save_steps 4, --resume_from_checkpoint ...). Needs transformers,
accelerate and zero_ext's deepspeed compatibility package (scripts/setup.sh installs all three).
"""
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainingArguments


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n=64, length=16, vocab=64):
        self.x = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def deepspeed_state_on_cpu():
    """Without a GPU, accelerate gives DeepSpeed no process-group backend and runs every rank alone; making
    its state first with gloo fixes that (TrainingArguments then takes it: use_configured_state)."""
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    del os.environ["ACCELERATE_USE_DEEPSPEED"]
    return {"accelerator_config": {"use_configured_state": True}}


def main():
    extra = {}
    if not torch.cuda.is_available() and "RANK" in os.environ:
        extra = deepspeed_state_on_cpu()
    # parsed to a namespace first: TrainingArguments must be built after the state above exists
    args = TrainingArguments(**{**vars(HfArgumentParser(TrainingArguments).parse_args()), **extra})
    torch.manual_seed(0)
    # built after TrainingArguments: under a ZeRO-3 config, from_pretrained / from_config would build it
    # partitioned (deepspeed.zero.Init); a model built directly is partitioned by deepspeed.initialize
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens())
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if args.process_index == 0:
        print("losses:", [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h])


if __name__ == "__main__":
    main()
