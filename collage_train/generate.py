"""Sample text from a trained model: ``python -m collage_train.generate PATH``.

PATH is a run directory (its ``hf/`` export, else its newest checkpoint), an ``hf/``
export, or a ``checkpoints/step-N`` directory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from collage_train.cpu_bf16 import choose_cpu_bf16_gemm
from collage_train.data import Tokenizer
from collage_train.errors import (
    BAD_INPUT,
    WEIGHT_LOAD_ERRORS,
    CollageError,
    ConfigError,
    first_line,
)
from collage_train.export import load_checkpoint_model, resolve_checkpoint
from collage_train.model.decodable import decodable_only
from collage_train.model.hf_modeling import AutoModelForCausalLM, PreTrainedModel

# The sampling of the command and of the end-of-run sample (logging.sample_tokens): the
# command with --seed SEED and --max-new-tokens N writes that sample again
TEMPERATURE = 0.8
TOP_K = 50


def load_for_generation(path: Path) -> tuple[PreTrainedModel, Tokenizer]:
    """Model and tokenizer from a run directory, an hf/ export or a checkpoint."""
    if (path / "hf" / "config.json").is_file():
        path = path / "hf"
    if (path / "config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(path), Tokenizer.load(path)
    return load_checkpoint_model(resolve_checkpoint(path))


def prompt_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """What generation starts from: a document start, then the prompt."""
    return [tokenizer.eot_id, *tokenizer.encode(prompt)]


def context_length(model: PreTrainedModel) -> int | None:
    """The positions the model was built for (GPT-2: ``n_positions``; OPT and Llama:
    ``max_position_embeddings``), None if its config names none."""
    for key in ("n_positions", "max_position_embeddings"):
        value = getattr(model.config, key, None)
        if isinstance(value, int):
            return value
    return None


def generate(
    model: PreTrainedModel,
    tokenizer: Tokenizer,
    prompt: str,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    seed: int,
    every_rank: bool = False,
) -> str:
    """Continue ``prompt`` by up to ``max_new_tokens`` (fewer where the model's context
    ends; a prompt that fills it is a ``ConfigError``); temperature 0 decodes greedily.
    Only ids the tokenizer can decode are drawn (``decodable``: a padded vocabulary's
    extra rows never are).

    A bf16 model on a CPU whose bf16 GEMM is slow computes its products as fp32 GEMMs
    (``collage_train.cpu_bf16``, chosen as ``train.cpu_bf16_gemm=auto`` would).
    ``every_rank``: every rank of the launch calls this with the same arguments and keeps
    running forwards until all are done (DeepSpeed ZeRO-3 gathers each layer from them all).
    """
    torch.manual_seed(seed)
    ids = prompt_ids(tokenizer, prompt)
    context = context_length(model)
    if context is not None:  # the model has no positions past its context
        if len(ids) >= context:
            raise ConfigError(
                f"the prompt is {len(ids) - 1} tokens and the model reads at most "
                f"{context - 1} after the document start: shorten it"
            )
        max_new_tokens = min(max_new_tokens, context - len(ids))
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
            synced_gpus=every_rank,
            logits_processor=decodable_only(tokenizer.vocab_size),
            **(sampling if temperature > 0 else {"do_sample": False}),
        )
    return prompt + tokenizer.decode(output[0, len(ids) :].tolist())


def sample_after_training(
    model: PreTrainedModel,
    tokenizer: Tokenizer,
    prompt: str,
    *,
    max_new_tokens: int,
    seed: int,
    every_rank: bool = False,
) -> str:
    """The end-of-run sample (``logging.sample_tokens``): ``generate`` as the command does
    by default, in eval mode and eager (a compiled model would compile again for every
    length), leaving the run's random streams and the model's mode as they were."""
    was_training = model.training
    devices = [model.device] if model.device.type == "cuda" else []
    model.eval()
    try:
        with torch.random.fork_rng(devices=devices), torch.compiler.set_stance("force_eager"):
            return generate(
                model,
                tokenizer,
                prompt,
                max_new_tokens=max_new_tokens,
                temperature=TEMPERATURE,
                top_k=TOP_K,
                seed=seed,
                every_rank=every_rank,
            )
    finally:
        model.train(was_training)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collage_train.generate", description=__doc__)
    parser.add_argument("path", type=Path, help="run directory, hf/ export or checkpoint directory")
    parser.add_argument("--prompt", default="def ", help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--temperature", type=float, default=TEMPERATURE, help="0 for greedy decoding"
    )
    parser.add_argument("--top-k", type=int, default=TOP_K)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        model, tokenizer = load_for_generation(args.path)
    except (CollageError, *WEIGHT_LOAD_ERRORS) as err:
        print(f"error: cannot load {args.path}: {first_line(err)}", file=sys.stderr)
        return BAD_INPUT
    model.eval()
    try:
        text = generate(
            model,
            tokenizer,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
        )
    except ConfigError as err:
        print(f"error: --prompt: {err}", file=sys.stderr)
        return BAD_INPUT
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
