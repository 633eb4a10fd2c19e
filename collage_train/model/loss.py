"""The language-model loss a block of tokens at a time: output projection and fp32
cross-entropy fused, so that no step holds the whole micro-batch's logits.

``chunked_cross_entropy`` walks the tokens in blocks of ``chunk_tokens`` and, when
gradients are wanted, computes them in the same pass: per block the logits, their fp32
log-softmax, the summed loss and the block's gradients of the hidden states and of ``W``
(summed in fp32 across blocks, rounded once); backward only scales what the forward stored.
Contract: per block, the plain loss's arithmetic (``F.cross_entropy(logits.float())``), so
the loss is bitwise the plain one's when the logits are and the gradients differ by fp32
summation order only; one block covering the micro-batch (``tokens <= chunk_tokens``) runs
the plain loss unchanged. ``install_chunked_loss`` swaps the output embedding for
``ChunkedLossHead`` (the same ``weight`` Parameter: keys and ties stay); the model's
``forward`` given ``targets=`` runs the base model, then the head; without, it is transformers'.
Arithmetic, tests, memory, why not Liger: docs/design.md, "The chunked loss head".
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutputWithPast

_ROUNDING_SLAB_ELEMENTS = 1 << 24  # rows of the fp32 accumulator rounded in place at once


# ------------------------------------------------------------------ the arithmetic


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's GEMMs run in: autocast's where it is on, else the weight's."""
    device_type = weight.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


def _block_log_softmax(
    x: torch.Tensor, w: torch.Tensor, rounding: torch.dtype | None
) -> torch.Tensor:
    """fp32 log-softmax of one block's logits ``x @ w^T``: computed in ``x``'s dtype, or,
    with ``rounding``, an fp32 GEMM whose result is rounded to ``rounding`` in place."""
    logits = torch.mm(x, w.t())
    if rounding is None:
        logits = logits.float()  # the compute-dtype logits are freed here
    else:
        logits.copy_(logits.to(rounding))
    return torch.log_softmax(logits, dim=-1)


def _gemm_adds_into_fp32(device: torch.device) -> bool:
    """Whether ``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)`` takes bf16
    ``a``, ``b`` and an fp32 ``acc`` on ``device`` (CUDA with a recent torch)."""
    return device.type == "cuda" and _probe_fp32_addmm(device)


@torch.compiler.disable  # probed eagerly, once per device, also under train.compile
@functools.cache
def _probe_fp32_addmm(device: torch.device) -> bool:
    a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
    acc = torch.zeros(2, 2, dtype=torch.float32, device=device)
    try:
        add_low_precision_product(acc, a, a)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool(acc.eq(2).all())


def add_low_precision_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` for bf16/fp16 ``a``, ``b``: one GEMM that multiplies exactly,
    accumulates in fp32 and adds its unrounded sum to the fp32 ``acc`` in place."""
    torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)


def _chunked_pass(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int,
    compute_dtype: torch.dtype,
    *,
    grad_hidden: bool,
    grad_weight: bool,
    grad_scale: torch.Tensor | None = None,
    fp32_output_gemm: bool = False,
    fp32_gemms: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The mean cross-entropy of ``hidden @ weight^T`` against ``targets`` (flat: tokens
    x hidden, tokens), and, as asked, its gradients for a loss gradient of ``grad_scale``
    (an fp32 0-d tensor) with respect to the hidden states (compute dtype) and to the
    weight (fp32, unrounded). ``fp32_output_gemm``: the weight's gradient may accumulate
    through ``add_low_precision_product`` (``_gemm_adds_into_fp32``).

    ``fp32_gemms``: compute-dtype products as ``collage_train.cpu_bf16`` computes them on
    a CPU without fast bf16 (an fp32 GEMM on the exactly up-cast operands, rounded once):
    the weight up-cast once per pass and each block's hidden states once per block,
    instead of both operands for every product the dispatch mode sees, and the rounded
    values kept in fp32 storage for the next GEMM instead of a compute-dtype copy that
    the next GEMM up-casts again. The same values, fewer passes over each block's logits.
    """
    tokens = hidden.shape[0]
    x = hidden.to(compute_dtype)
    w = weight.to(compute_dtype)
    rounding = compute_dtype if fp32_gemms and compute_dtype != torch.float32 else None
    if rounding is not None:
        w = w.float()  # exact
    picked = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
    d_hidden = torch.empty_like(x) if grad_hidden else None
    d_weight = (
        torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if grad_weight
        else None
    )
    # nll_loss's backward: the loss's gradient over the token count, in fp32
    if grad_scale is None:
        grad_scale = torch.ones((), dtype=torch.float32, device=hidden.device)
    per_token = grad_scale / tokens
    for start in range(0, tokens, chunk_tokens):
        end = min(start + chunk_tokens, tokens)
        x_block, t_block = x[start:end], targets[start:end]
        if rounding is not None:
            x_block = x_block.float()  # exact
        log_probs = _block_log_softmax(x_block, w, rounding)
        rows = torch.arange(end - start, device=hidden.device)
        picked[start:end] = log_probs[rows, t_block]
        if d_hidden is None and d_weight is None:
            continue
        # log_softmax's backward of nll_loss's gradient (-per_token at the target):
        # exp(log p) * per_token, and at the target that minus per_token
        d_logits = log_probs.exp_().mul_(per_token)
        d_logits[rows, t_block] -= per_token
        if compute_dtype == torch.float32 or rounding is not None:
            if rounding is not None:  # the rounded values, in the fp32 block's storage
                d_logits.copy_(d_logits.to(rounding))
            if d_hidden is not None:  # rounded to the compute dtype as it is stored
                d_hidden[start:end] = torch.mm(d_logits, w)
            if d_weight is not None:
                d_weight.addmm_(d_logits.t(), x_block)
        else:
            rounded = d_logits.to(compute_dtype)
            if d_hidden is not None:
                d_hidden[start:end] = torch.mm(rounded, w)
            if d_weight is not None and fp32_output_gemm:
                add_low_precision_product(d_weight, rounded.t(), x_block)
            elif d_weight is not None:  # the rounded values up-cast in the fp32 block's storage
                d_weight.addmm_(d_logits.copy_(rounded).t(), x_block.float())
            del rounded
        del d_logits, log_probs
    zeros = torch.zeros(tokens, dtype=torch.long, device=hidden.device)
    loss = F.nll_loss(picked.unsqueeze(1), zeros)  # the plain loss's mean, same order
    return loss, d_hidden, d_weight


def _round_in_place(acc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``acc`` (fp32) holding its values rounded to ``dtype``, a slab of rows at a time."""
    rows = max(1, _ROUNDING_SLAB_ELEMENTS // max(1, acc[0].numel()))
    for start in range(0, acc.shape[0], rows):
        slab = acc[start : start + rows]
        slab.copy_(slab.to(dtype))
    return acc


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight^T``; gradients formed in forward."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk_tokens: int,
        compute_dtype: torch.dtype,
        grad_scale: float,
        fp32_output_gemm: bool,
        fp32_gemms: bool,
    ) -> torch.Tensor:
        expected = torch.tensor(grad_scale, dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            loss, d_hidden, d_weight = _chunked_pass(
                hidden,
                weight,
                targets,
                chunk_tokens,
                compute_dtype,
                grad_hidden=ctx.needs_input_grad[0],
                grad_weight=ctx.needs_input_grad[1],
                grad_scale=expected,
                fp32_output_gemm=fp32_output_gemm,
                fp32_gemms=fp32_gemms,
            )
        ctx.d_hidden, ctx.d_weight, ctx.expected = d_hidden, d_weight, expected
        ctx.hidden_dtype, ctx.weight_dtype, ctx.compute_dtype = (
            hidden.dtype,
            weight.dtype,
            compute_dtype,
        )
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        d_hidden, d_weight = ctx.d_hidden, ctx.d_weight
        ctx.d_hidden = ctx.d_weight = None  # freed as they are handed on
        # 1 exactly when the loss receives the gradient it was told (grad_scale)
        ratio = grad_loss.float() / ctx.expected
        if d_hidden is not None:
            d_hidden = d_hidden.mul_(ratio).to(ctx.hidden_dtype)
        if d_weight is not None:
            d_weight.mul_(ratio)  # fp32, before the one rounding
            if ctx.weight_dtype == torch.float32 and ctx.compute_dtype != torch.float32:
                d_weight = _round_in_place(d_weight, ctx.compute_dtype)  # autocast's value
            else:
                d_weight = d_weight.to(ctx.weight_dtype)
        return d_hidden, d_weight, None, None, None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int,
    grad_scale: float = 1.0,
    fp32_gemms: bool = False,
) -> torch.Tensor:
    """Mean cross-entropy of the logits ``hidden @ weight^T`` (``hidden``: (..., width),
    ``targets``: (...)) over every token, ``chunk_tokens`` tokens at a time (module
    docstring). Runs in autocast's dtype where autocast is on, else in the weight's.

    ``grad_scale``: the gradient the loss will receive in backward (the engines divide
    the loss by the accumulation steps: 1 / steps). The gradients are formed with it, as
    the plain loss forms them; a different one is applied afterwards (one more rounding).
    ``fp32_gemms``: bf16 products as ``collage_train.cpu_bf16`` computes them, with fewer
    casts than its dispatch mode would make (``_chunked_pass``); the same values.
    """
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    if flat_hidden.shape[0] <= chunk_tokens:  # one block: the plain loss, bit for bit
        logits = F.linear(hidden, weight)
        with torch.autocast(hidden.device.type, enabled=False):
            return F.cross_entropy(logits.float().flatten(0, -2), flat_targets)
    compute_dtype = _compute_dtype(weight)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(
            flat_hidden,
            weight,
            flat_targets,
            chunk_tokens,
            compute_dtype,
            grad_scale,
            _gemm_adds_into_fp32(weight.device),
            fp32_gemms,
        )
    with torch.autocast(hidden.device.type, enabled=False), torch.no_grad():
        loss, _, _ = _chunked_pass(
            flat_hidden,
            weight,
            flat_targets,
            chunk_tokens,
            compute_dtype,
            grad_hidden=False,
            grad_weight=False,
            fp32_gemms=fp32_gemms,
        )
    return loss


# ------------------------------------------------------------------ the model's side


class ChunkedLossHead(torch.nn.Linear):
    """A bias-free ``nn.Linear`` LM head holding another head's ``weight`` Parameter:
    ``head(hidden)`` gives the logits, ``head(hidden, targets)`` the mean cross-entropy
    computed ``chunk_tokens`` tokens at a time (``chunked_cross_entropy``, with
    ``fp32_gemms``)."""

    def __init__(self, head: torch.nn.Linear, chunk_tokens: int, fp32_gemms: bool = False) -> None:
        torch.nn.Module.__init__(self)  # not Linear's: it would create a new weight
        self.in_features, self.out_features = head.in_features, head.out_features
        self.weight = head.weight
        self.register_parameter("bias", None)
        self.chunk_tokens = chunk_tokens
        self.fp32_gemms = fp32_gemms

    def forward(  # type: ignore[override]
        self, hidden: torch.Tensor, targets: torch.Tensor | None = None, grad_scale: float = 1.0
    ) -> torch.Tensor:
        if targets is None:
            return super().forward(hidden)
        return chunked_cross_entropy(
            hidden,
            self.weight,
            targets,
            self.chunk_tokens,
            grad_scale=grad_scale,
            fp32_gemms=self.fp32_gemms,
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunk_tokens={self.chunk_tokens}"


def _forward_with_targets(
    self: torch.nn.Module,
    input_ids: torch.Tensor | None = None,
    targets: torch.Tensor | None = None,
    grad_scale: float = 1.0,
    **kwargs: Any,
) -> Any:
    """The model's forward: with ``targets``, the chunked loss (``.loss``; no logits;
    ``grad_scale``: ``chunked_cross_entropy``'s); without, the transformers forward."""
    if targets is None:
        return type(self).forward(self, input_ids=input_ids, **kwargs)
    hidden = self.base_model(input_ids=input_ids, **kwargs)[0]  # after the final norm
    head = self.get_output_embeddings()
    return CausalLMOutputWithPast(loss=head(hidden, targets, grad_scale))


def install_chunked_loss(
    model: torch.nn.Module, chunk_tokens: int, *, fp32_gemms: bool = False
) -> None:
    """Make ``model(input_ids=..., targets=...)`` return the chunked loss, in place.

    ``fp32_gemms``: the run computes bf16 products as ``collage_train.cpu_bf16``'s fp32
    GEMMs (``CpuBf16Gemm.emulates``); the loss then does so itself, with fewer casts.

    Parameters, their names and ties are unchanged; only the output embedding's class
    (``ChunkedLossHead``) and the instance's ``forward`` change. Install it before an
    engine wraps the model (DeepSpeed ZeRO-3 hooks the modules it finds then).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        raise TypeError(
            f"the chunked loss needs a bias-free nn.Linear LM head, not {type(head).__name__}"
        )
    model.set_output_embeddings(ChunkedLossHead(head, chunk_tokens, fp32_gemms))
    model.forward = types.MethodType(_forward_with_targets, model)
