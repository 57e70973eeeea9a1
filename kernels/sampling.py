"""Sampling hot paths: logits -> processed probabilities, and seeded sampling from them.

Vocabulary: a *key* is (seed, position, purpose). Every random draw the engine makes is a pure
function of its key, so a seeded request gives the same tokens whatever it is batched with.
Purposes separate the draws made at one position (drafting, accepting, resampling, sampling).

Sampling is an exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) picks i with
probability p_i (the Gumbel-max trick in another form), and needs no cumulative sum.
"""
from __future__ import annotations

import torch

# Purposes of a draw at one position.
SAMPLE, DRAFT, ACCEPT, RESIDUAL = 0, 1, 2, 3
_MASK64 = (1 << 64) - 1


def key_seed(seed: int, position: int, purpose: int) -> int:
    """splitmix64 of the key, folded to a non-negative 63-bit generator seed."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + purpose * 0x94D049BB133111EB)
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def keyed_uniform(seed: int, position: int, purpose: int, n: int, device="cpu") -> torch.Tensor:
    """[n] float64 uniforms in (0, 1), a pure function of the key."""
    gen = torch.Generator(device=device).manual_seed(key_seed(seed, position, purpose))
    u = torch.rand(n, generator=gen, dtype=torch.float64, device=device)
    return u.clamp_(min=torch.finfo(torch.float64).tiny)


def compute_probs_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus), renormalised. Rows must have T > 0.

    logits: [R, V]; temperature, top_p: [R] float; top_k: [R] int (0 = off) -> probs [R, V]
    """
    assert logits.ndim == 2 and temperature.shape == top_k.shape == top_p.shape == logits.shape[:1]
    assert bool((temperature > 0).all()), "greedy rows take the argmax, not probabilities"
    vocab = logits.shape[1]
    scaled = logits.float() / temperature.float().unsqueeze(1)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    if bool((k < vocab).any()):
        kth = torch.sort(scaled, dim=1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=1)
    if bool((top_p < 1).any()):
        sorted_p, order = torch.sort(probs, dim=1, descending=True)
        mass_before = sorted_p.cumsum(dim=1) - sorted_p
        drop_sorted = mass_before >= top_p.float().unsqueeze(1)  # keeps the top-1 always
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=1, keepdim=True)
    return probs


def sample_ref(probs: torch.Tensor, seeds: list[int], positions: list[int],
               purpose: int) -> torch.Tensor:
    """One token per row by exponential race with keyed noise.

    probs: [R, V] (rows sum to 1); seeds, positions: R ints -> [R] int64
    """
    assert probs.ndim == 2 and len(seeds) == len(positions) == probs.shape[0]
    out = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
    for r, (seed, pos) in enumerate(zip(seeds, positions)):
        u = keyed_uniform(seed, pos, purpose, probs.shape[1], device=probs.device)
        out[r] = torch.argmax(probs[r].double() / -torch.log(u))
    return out


def compute_probs(logits, temperature, top_k, top_p, impl: str | None = None):
    """Dispatch: the Triton kernel on CUDA tensors (or impl="triton"), the reference otherwise."""
    return compute_probs_ref(logits, temperature, top_k, top_p)


def sample(probs, seeds, positions, purpose, impl: str | None = None):
    return sample_ref(probs, seeds, positions, purpose)
