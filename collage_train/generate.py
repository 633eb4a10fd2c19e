"""Sample text from a trained model: ``python -m collage_train.generate PATH``.

PATH is a run directory (its ``hf/`` export, else its newest checkpoint), an ``hf/``
export, or a ``checkpoints/step-N`` directory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from collage_train.cpu_bf16 import choose_cpu_bf16_gemm
from collage_train.data import Tokenizer
from collage_train.errors import BAD_INPUT, WEIGHT_LOAD_ERRORS, CollageError, first_line
from collage_train.export import load_checkpoint_model, resolve_checkpoint


def load_for_generation(path: Path) -> tuple[PreTrainedModel, Tokenizer]:
    """Model and tokenizer from a run directory, an hf/ export or a checkpoint."""
    if (path / "hf" / "config.json").is_file():
        path = path / "hf"
    if (path / "config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(path), Tokenizer.load(path)
    return load_checkpoint_model(resolve_checkpoint(path))


def generate(
    model: PreTrainedModel,
    tokenizer: Tokenizer,
    prompt: str,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    seed: int,
) -> str:
    """Continue ``prompt``; temperature 0 decodes greedily.

    A bf16 model on a CPU whose bf16 GEMM is slow computes its products as fp32 GEMMs
    (``collage_train.cpu_bf16``, chosen as ``train.cpu_bf16_gemm=auto`` would).
    """
    torch.manual_seed(seed)
    ids = [tokenizer.eot_id, *tokenizer.encode(prompt)]
    input_ids = torch.tensor([ids], device=model.device)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": top_k}
    gemm = choose_cpu_bf16_gemm("auto", model.device, model.dtype == torch.bfloat16)
    with gemm.context(compiled=False):
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.eot_id,
            eos_token_id=tokenizer.eot_id,
            **(sampling if temperature > 0 else {"do_sample": False}),
        )
    return prompt + tokenizer.decode(output[0, len(ids) :].tolist())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collage_train.generate", description=__doc__)
    parser.add_argument("path", type=Path, help="run directory, hf/ export or checkpoint directory")
    parser.add_argument("--prompt", default="def ", help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        model, tokenizer = load_for_generation(args.path)
    except (CollageError, *WEIGHT_LOAD_ERRORS) as err:
        print(f"error: cannot load {args.path}: {first_line(err)}", file=sys.stderr)
        return BAD_INPUT
    model.eval()
    text = generate(
        model,
        tokenizer,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
